"""The gateway's settings and the tenants it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, StringConstraints, field_validator, model_validator

from clawr1.core.config._base import TENANT_NAME, _Section


class GatewayConfig(_Section):
    host: str = Field("127.0.0.1", min_length=1, max_length=255)
    """Address to bind. Loopback by default; any other address requires `api_keys`."""

    port: int = Field(8000, ge=0, le=65535)
    """TCP port (0 = any free port)."""

    api_keys: list[Annotated[str, StringConstraints(min_length=8, max_length=512)]] = Field(
        default_factory=list, max_length=10_000)
    """Bearer keys agents must send, each at least 8 characters (an empty one, say from an unset
    shell variable, would let in a request with no key at all). Empty list: no auth, and the
    gateway only binds to loopback."""

    tls_cert: Path | None = None
    """PEM certificate (chain) to serve HTTPS with (uvicorn's TLS); set with `tls_key`. Unset:
    plain HTTP, which is fine on loopback; across a network, set both."""

    tls_key: Path | None = None
    """PEM private key of `tls_cert`."""

    admin_key: str | None = Field(None, min_length=16, max_length=512)
    """Separate key for `/admin/*` routes; unset = admin routes disabled."""

    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, le=1024**3)
    """Largest accepted request body; larger gets 413."""

    max_request_store_bytes: int = Field(16 * 1024**2, ge=1024, le=1024**3)
    """Most a request may add to the pool: its stored messages and tools (what the chat template
    rendered) and prompt tokens, once per generation (prompts x `n`); more is a 413 before anything
    runs. A 8,192-token context with `n` = 8 stores about 2 MB."""

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

    workers: int = Field(1, ge=1, le=64)
    """Gateway processes on the one port, for more than one core's worth of requests: a front
    process routes each request to the worker that holds its session (`gateway/dispatch.py`).
    Worker 0 also runs the background jobs and decides what version serves; the others follow it.
    Each has its own engine client (with the local engine, its own copy of the model: meant for
    `engine.backend` vllm or sglang) and its own `max_pending`."""

    fronts: int = Field(1, ge=1, le=64)
    """Front processes accepting on the port with `workers` > 1 (the leader binds it; each front
    accepts on that one socket). Routing needs no shared state, so they add up as workers do; a
    front's CPU a request is about a bare proxy's (~0.13 ms on the benchmark machine, a worker's
    ~0.27 ms)."""

    max_pending: int = Field(256, ge=1, le=100_000)
    """Requests being served or recorded at once; beyond it new requests get 429, so a slow pool
    never makes the gateway lose data silently."""

    tenant_share: float = Field(0.5, gt=0, le=1)
    """Most of `max_pending` one tenant may hold at once when the gateway serves named tenants
    (`tenants.keys`); past it that tenant's requests get 429 while the others still find room, so
    no tenant (a burst, streams nobody reads) takes every slot. 1: no per-tenant bound. With k
    tenants that may all be greedy at once, 1/(k+1) keeps room for one more."""

    send_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Longest one write of a reply may wait for the client to take it (a stream nobody reads fills
    the socket's buffers, and the next write waits); past it, or past the request's deadline
    (`request_timeout_s`) while it waits, the client is taken as gone: the work is cancelled, the
    step stored as `aborted`, and its admission slot freed."""

    auth_failures_per_minute: int = Field(30, ge=1, le=1_000_000)
    """Failed key checks (an unknown agent or session key, a wrong admin key or dashboard sign-in)
    one client address may make in a minute; past them every request from that address gets 429
    until the minute is over, whatever key it carries."""

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


class TenantsConfig(_Section):
    keys: dict[str, list[str]] = Field(default_factory=dict, max_length=10_000)
    """Agent keys of named tenants, `{acme = ["sk-..."], globex = ["sk-..."]}`. A tenant's sessions,
    samples, exports and (with `adapter_per_tenant`) adapter are its own; `gateway.api_keys` belong
    to the tenant `default`. Keys are secrets: never printed or logged."""

    storage_quota_bytes: int = Field(20 * 1024**3, ge=1024**2, le=1024**5)
    """What one tenant's steps may take in the pool (`clawr1 pool stats --tenant T`: `stored_bytes`);
    past it, that tenant's generation requests get 429 `insufficient_quota` and no other tenant
    notices. The gateway reads the pool's counts every few seconds, so a tenant may overshoot by
    those seconds' writes."""

    storage_quotas: dict[str, int] = Field(default_factory=dict, max_length=10_000)
    """Per-tenant exceptions to `storage_quota_bytes`, `{acme = 100_000_000_000}` (bytes)."""

    adapter_per_tenant: bool = False
    """Train one LoRA adapter per tenant (`policy-<tenant>`) on that tenant's samples only, and serve
    it only to that tenant: one base model, adapters batched per row. Off: one shared policy."""

    def quota_of(self, tenant: str) -> int:
        return self.storage_quotas.get(tenant, self.storage_quota_bytes)

    @field_validator("storage_quotas")
    @classmethod
    def _quotas(cls, quotas: dict[str, int]) -> dict[str, int]:
        for tenant, quota in quotas.items():
            if quota < 1024**2:
                raise ValueError(f"tenants.storage_quotas[{tenant!r}] = {quota}: at least 1 MiB (1048576)")
        return quotas

    @field_validator("keys")
    @classmethod
    def _valid(cls, keys: dict[str, list[str]]) -> dict[str, list[str]]:
        import re

        seen: set[str] = set()
        for tenant, values in keys.items():
            if not re.fullmatch(TENANT_NAME, tenant):
                raise ValueError(f"tenant name {tenant!r} must match {TENANT_NAME}")
            for key in values:
                if len(key) < 8 or key in seen:
                    raise ValueError(f"tenant {tenant!r}: every key must be unique and at least 8 characters")
                seen.add(key)
        return keys
