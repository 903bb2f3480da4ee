"""The trainer's settings, local or on a Tinker-compatible service."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from clawr1.core.config._base import _Section


def ranks_device_error(device: str, ranks: int) -> str | None:
    """Why `trainer.device` cannot serve `ranks` data-parallel ranks (None: it can). `cuda:N` puts
    every rank on GPU N while each rank's NCCL communicator is bound to its own `cuda:LOCAL_RANK`
    (`trainer/ranks.py`): their collectives would run on GPUs their tensors are not on."""
    if ranks > 1 and re.fullmatch(r"cuda:\d+", device):
        return (f"trainer.device = {device!r} with {ranks} trainer ranks would put every rank on that one GPU; "
                "use \"cuda\" (each rank its own cuda:LOCAL_RANK) or \"auto\", and CUDA_VISIBLE_DEVICES to choose GPUs")
    return None


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
    `engine.device` (engine on cuda:0, trainer on cuda:1) or share it. `cuda:N` is refused with
    several ranks (all would share GPU N)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype the decoder computes in (`auto`: bfloat16 on a CUDA card that computes in it, Ampere
    or newer; float32 elsewhere). With LoRA, the frozen base weights are stored in it, and the LoRA
    weights and their AdamW state stay float32 (master weights). With full fine-tuning, bfloat16
    is mixed precision: every trained weight, its gradient and AdamW's state stay float32, the
    decoder runs under bfloat16 autocast, and the frozen base kept for `kl_coef` or the base
    teacher is stored in bfloat16 (half a float32 copy). Logprobs, KL and entropy are float32.
    float16 is not offered: it would need loss scaling, or small gradients underflow to zero."""

    grad_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them
    (non-reentrant checkpointing): less memory for long replies, about a third more compute."""

    quantize: Literal["none", "4bit", "8bit"] = "none"
    """Base weights in 4-bit (NF4) or 8-bit for LoRA (QLoRA through `bitsandbytes`: `pip install
    -e .[qlora]`, CUDA only); refused with a clear error where that cannot run. The trainer then
    computes with other base weights than an engine serving the bfloat16 base: on SmolLM2-135M
    63% of the sampled tokens' PPO ratios fall outside the clip before any training (`clawr1 bench
    precision`, docs/scale.md); measure yours first, or serve the same quantized base."""

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

    reject_backoff: float = Field(0.5, gt=0, le=1)
    """After each candidate the guard rejects in a row, the learning rate of the steps that follow
    is multiplied by this (0.5: half, then a quarter, ...) until a version is promoted; 1: off.
    A rejection puts the weights and optimizer back to the incumbent's, so without it the next
    candidate is the same kind of step: from the base, a fresh AdamW's first step moves every
    weight by the same lr whatever the batch, and the guard rejected such steps forever."""

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
    """Module names that get LoRA adapters: every projection of every block. Not the LM head or the
    embeddings (refused): the trainer's fused head reads the head's weight itself, so an adapter on
    it would be trained on one computation and served by another; on Qwen2.5-Coder-0.5B's untied
    head (136 M of its 630 M parameters) the blocks' adapters are 4.4 M parameters at rank 8."""

    @field_validator("lora_targets")
    @classmethod
    def _not_the_head(cls, targets: list[str]) -> list[str]:
        refused = [t for t in targets if t in ("lm_head", "embed_tokens", "embed_out", "wte", "output")]
        if refused:
            raise ValueError(f"trainer.lora_targets {refused}: the LM head and the embeddings take no adapter "
                             "(the fused head reads the head's weight itself)")
        return targets

    eps_low: float = Field(0.2, ge=0, le=1)
    """PPO clip: the ratio may fall to 1 - eps_low."""

    eps_high: float = Field(0.28, ge=0, le=10)
    """PPO clip: the ratio may rise to 1 + eps_high (asymmetric, as in DAPO)."""

    dual_clip: float = Field(3.0, gt=1, le=1000)
    """PPO's dual clip (Ye et al. 2020), for tokens with a negative advantage: the objective is
    held at `dual_clip` x advantage or above, so a token whose ratio grew large (the learner now
    likes it far more than the sampler did) cannot push the loss, and the step, without bound.
    Local trainer only (a Tinker service computes its own PPO loss)."""

    kl_coef: float = Field(0.1, ge=0, le=10)
    """Weight of a KL penalty to the base model (free with LoRA: the adapter switched off). The
    defaults of this section are one measured setting (docs/demo.md, The personal-agent demo): with 0 and
    the earlier defaults the demo's users drove the replies into nonsense; 0.2 held quality but
    learned nothing in 8 versions; 0.1 with the full-vocabulary estimator, the base teacher, the EMA
    baseline and negative_weight 0.3 learned a little (held-out preferred-and-sane 0.08 -> 0.21-0.33
    by v8) with the replies mostly in the base's range (0.88-0.92 sane through v13, 0.75 at v16)."""

    kl_estimator: Literal["k3", "full"] = "full"
    """How the KL penalty is measured at each reply position: `k3`, Schulman's estimator on the
    sampled token only (sees only where the samples went; its gradient is the forward KL's,
    KL(base || policy), though its value estimates the reverse); `full`, the exact KL(policy || base)
    over the whole vocabulary, which also holds the probability the policy moves off the sampled
    tokens near where the base had it (a trust region that holds under mostly negative rewards).
    Either way the full KL is logged (`kl_base`): every step, or as `kl_base_every` says when the
    penalty is off; both take what they need from the one forward of the base model a micro-batch."""

    kl_base_every: int = Field(1, ge=0, le=10_000)
    """With `kl_coef = 0` the KL to the base model is only a metric (`kl_base`, the dashboard's
    drift curve), and measuring it costs a forward pass of the base model on every micro-batch:
    about a quarter of a LoRA step on the CPU. Measure it on every Nth optimizer step only (0:
    never). With `kl_coef > 0` the penalty needs it, so it is measured every step whatever this says."""

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

    loss_average: Literal["token", "sample"] = "token"
    """How the policy-gradient term averages over a lease: `token`, one mean over all its reply
    tokens (DAPO's token-level loss: a long reply weighs more than a short one); `sample`, each
    sample's token mean, scaled by the lease's mean reply length so the loss keeps its size
    (GRPO's original sequence mean: every reply weighs the same, so a short reply's tokens, its
    end-of-sequence token included, each count for more). The KL and entropy terms stay token means."""

    opd_estimator: Literal["sampled", "full"] = "sampled"
    """How OPD measures the teacher: `sampled`, the teacher-minus-behaviour logprob of each sampled
    token as its advantage (OpenClaw-RL's estimator: it can only raise or lower tokens the policy
    sampled); `full`, the exact KL(policy || teacher) over the whole vocabulary at every reply
    position of a hinted sample, weighted by `w_opd` (the same objective without the sampling: it
    also moves probability to tokens the policy did not sample, such as ending the reply early).
    Measured in the demo (docs/demo.md): `full` learned no more than `sampled` and lowered the sane
    rate, because the 135M base with a complaint in its context is itself a poor teacher; so the
    default stays `sampled`."""

    stop_coef: float = Field(0.0, ge=0, le=100)
    """Weight of the stop term (0 = off; `opd` and `combine`, with `opd_estimator = "sampled"`): at
    every reply position of a hinted sample, the KL between the hinted teacher's and the policy's
    probability of ending the reply there (two outcomes: end, go on), a token mean. OPD on sampled
    tokens can only move the token the policy drew, and a reply it did not end was never offered
    the end; this gives the stop decision the teacher's view directly, and nothing else of the
    vocabulary (which `full` moves too)."""

    hint_at: Literal["user", "system"] | None = None
    """Where the OPD teacher reads the hint: `user`, appended to the turn's last user message (as
    OpenClaw-RL does); `system`, as guidance in the system prompt. Unset: the served model's own
    (`hint_at_for`, filled in when the trainer starts): `user` for SmolLM2-135M, `system` for every
    other model. A small teacher reads a hint in the user's message as a complaint to answer
    (apologies, a changed topic); in the system prompt as an instruction about how to answer the
    same question. Measured on the demo's held-out
    questions with each user's correction (24 replies each, 64 tokens): Qwen2.5-Coder-0.5B's hinted
    replies were preferred 0.42 of the time with the hint in the system prompt, 0.29 in the user's
    message, 0.12 without a hint (`python -m clawr1.demo.base_rates --hint system`)."""

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
        if self.stop_coef > 0 and (self.method == "rl" or self.opd_estimator == "full"):
            raise ValueError("trainer.stop_coef distils the hinted teacher's stop decision: it needs "
                             "trainer.method = \"opd\" or \"combine\" (hints), and opd_estimator = \"full\" "
                             "already contains it")
        return self
