"""The gateway: an OpenAI-compatible HTTP surface that serves through the engine and records every
call, token for token, into the data pool without making the reply wait for the write.

`Gateway` holds what every route shares (auth, admission, recording, session closing); the routes
themselves live in `chat.py`, `completions.py` and `lifecycle.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from clawr1.core.config import Config
from clawr1.core.records import DEFAULT_TENANT, POLICY, Step, adapter_name
from clawr1.core.types import EngineError, Generation, SamplingParams
from clawr1.datapool.base import DataPool, PoolFullError
from clawr1.engine import adapters
from clawr1.engine.base import Engine, GenerationStream
from clawr1.gateway import errors, schema
from clawr1.gateway.errors import APIError
from clawr1.gateway.metrics import GatewayMetrics, MetricsMiddleware
from clawr1.gateway.metrics import router as metrics_router
from clawr1.gateway.sessions import SESSION_KEY_PREFIX, SessionResolver, Turn, hash_key

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


_ID_TAG = uuid.uuid4().hex[:12]  # unique per process; a counter makes the rest (no urandom per request)
_ids = itertools.count()


def new_id(prefix: str) -> str:
    """`chatcmpl-...`, `cmpl-...`: unique across processes and restarts (they prefix step ids,
    which are the pool's idempotency keys)."""
    return f"{prefix}{_ID_TAG}{next(_ids):012x}"


class Caller(NamedTuple):
    tenant: str
    session_id: str | None  # set when the request came with a per-session key


class Gateway:
    def __init__(self, engine: Engine, pool: DataPool, config: Config):
        self.engine, self.pool, self.config = engine, pool, config
        self.sessions = SessionResolver(pool.last_turn)
        self.pending = 0  # steps admitted whose writes are not yet handed to the pool
        self._session_keys: dict[str, tuple[str, str]] = {}  # key sha256 -> (tenant, session id)
        self._tasks: set[asyncio.Task] = set()  # background closes, referenced until done
        self.swaps: list[tuple[float, str, int, float]] = []  # (when, adapter, version, load seconds)
        self.metrics = GatewayMetrics(self)  # `GET /metrics`; reads the fields above when scraped
        # Every agent key with its tenant: `gateway.api_keys` are the default tenant's.
        self.agent_keys = [(key.encode(), DEFAULT_TENANT) for key in config.gateway.api_keys] + [
            (key.encode(), tenant) for tenant, keys in config.tenants.keys.items() for key in keys]
        self.per_tenant = config.tenants.adapter_per_tenant
        self.full = config.trainer.finetune == "full"  # versions are whole weights, not adapters

    # ---- request plumbing -----------------------------------------------------------------
    async def read(self, request: Request, model: type[M]) -> M:
        raw = await request.body()
        if len(raw) > self.config.gateway.max_body_bytes:
            raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of "
                                f"{self.config.gateway.max_body_bytes}", code="request_too_large")
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from exc

    def authenticate(self, request: Request) -> Caller:
        """Agent keys (`gateway.api_keys`) or a per-session key; none needed when no keys are set
        (the gateway then only binds to loopback). A per-session key binds the request to its
        session; an unknown one is refused even without agent keys, so it never lands elsewhere."""
        auth = request.headers.get("authorization", "")
        return self.authorize(auth[7:].strip() if auth.startswith("Bearer ") else "")

    def authorize(self, token: str) -> Caller:
        """`authenticate` for a key taken from elsewhere (the Anthropic route reads `x-api-key`)."""
        if token.startswith(SESSION_KEY_PREFIX):
            bound = self._session_for_key(token)
            if bound is None:
                raise APIError(401, "unknown session key", code="invalid_api_key")
            return Caller(*bound)
        if not self.agent_keys:
            return Caller(DEFAULT_TENANT, None)
        given = token.encode()
        tenant = None
        for key, owner in self.agent_keys:  # compare with every key: the time says nothing of which matched
            if hmac.compare_digest(given, key):
                tenant = owner
        if tenant is None:
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return Caller(tenant, None)

    def _session_for_key(self, token: str) -> tuple[str, str] | None:
        digest = hash_key(token)
        bound = self._session_keys.get(digest)
        if bound is None:
            found = self.pool.session_by_key(digest)  # keys outlive restarts: they are in the pool
            if found is not None:
                bound = self._session_keys[digest] = (found[0], found[1])
        return bound

    def remember_session_key(self, digest: str, tenant: str, session_id: str) -> None:
        self._session_keys[digest] = (tenant, session_id)

    def require_admin(self, request: Request) -> None:
        admin = self.config.gateway.admin_key
        if admin is None:
            raise APIError(403, "admin routes are disabled: set gateway.admin_key", code="admin_disabled")
        auth = request.headers.get("authorization", "")
        if not (auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].strip(), admin)):
            raise APIError(401, "admin routes need the admin key (Authorization: Bearer <admin_key>)",
                           code="invalid_api_key")

    def adapter_of(self, tenant: str) -> str:
        """The adapter a tenant is served: its own with per-tenant adapters, else the shared one."""
        return adapter_name(tenant if self.per_tenant else None)

    def served_version(self, tenant: str = DEFAULT_TENANT) -> int:
        """The policy version a tenant's new requests get (0: the base model)."""
        if self.full:
            return self.engine.weights_version()
        return self.engine.adapters().get(self.adapter_of(tenant), 0)

    def admit(self, steps: int) -> None:
        """Shed load before anything could be lost: the requests in flight plus the pool's queue
        must have room for this request's steps, else 429."""
        queued = self.pool.pending_writes()
        if self.pending + steps > self.config.gateway.max_pending:
            raise APIError(429, f"{self.pending} requests are being served or recorded; retry shortly",
                           code="rate_limit_exceeded")
        if queued + self.pending + steps > self.config.pool.writer_queue:
            raise APIError(429, f"the data pool is behind ({queued} writes queued); retry shortly",
                           code="rate_limit_exceeded")
        self.pending += steps

    def start(self, prompt_ids: list[int], samplings: list[SamplingParams], tenant: str,
              affinity: str | None = None) -> list[GenerationStream]:
        """Admit and submit one generation per sampling, on the tenant's adapter when one is loaded
        (else the base model); the caller must `release` them. `affinity` keeps a session on one
        engine replica (its prefix cache)."""
        self.admit(len(samplings))
        name = self.adapter_of(tenant)
        adapter = name if name in self.engine.adapters() else None
        streams: list[GenerationStream] = []
        try:
            for sampling in samplings:
                streams.append(self.metrics.timed(self.engine.generate(prompt_ids, sampling, adapter, affinity)))
        except BaseException:
            for stream in streams:
                stream.cancel()
            self.pending -= len(samplings)
            raise
        return streams

    async def collect(self, request: Request, streams: list[GenerationStream]) -> tuple[list[Generation], str]:
        """Wait for whole generations; a client that disconnects or a request past its timeout
        cancels the engine work. Returns the generations (aborted ones included) and the outcome:
        `ok`, `disconnected` or `timeout`."""
        finals = asyncio.ensure_future(streams[0].final() if len(streams) == 1 else _all_final(streams))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({finals, gone}, timeout=self.config.gateway.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if finals in done:
                return _listed(finals.result()), "ok"
            for stream in streams:
                stream.cancel()
            return _listed(await finals), "disconnected" if gone in done else "timeout"
        finally:
            gone.cancel()

    def record(self, turn: Turn, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               gen: Generation, step_id: str, started: float) -> None:
        """Hand the step to the pool's queue (room was reserved by `admit`); it commits after the reply."""
        self.metrics.generation_done(gen)
        step = Step(step_id=step_id, tenant=turn.tenant, session_id=turn.session_id, prompt_id=turn.prompt_id,
                    turn_index=turn.turn_index, turn_type=turn.turn_type, messages=messages, tools=tools,
                    prompt_ids=gen.prompt_ids, token_ids=gen.token_ids, logprobs=gen.logprobs, text=gen.text,
                    policy_version=gen.version, adapter=gen.adapter, finish_reason=gen.finish_reason or "aborted",
                    temperature=gen.temperature, timings={"total_s": time.perf_counter() - started})
        try:
            future = self.pool.submit_step(step)
        except PoolFullError:  # only if another writer in this process filled the queue meanwhile
            log.error("pool queue full: step %s of session %s not recorded", step_id, turn.session_id)
            return
        future.add_done_callback(lambda f: _log_failure(f, step_id))

    async def settle_stream(self, turn: Turn, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            stream: GenerationStream, step_id: str, started: float) -> None:
        """Record a streamed step once its generation has ended (finished, or aborted because the
        client went away). Runs as its own task: a disconnect cancels the response's task, and the
        recording must not be cancelled with it."""
        try:
            self.record(turn, messages, tools, await stream.final(), step_id, started)
        finally:
            self.pending -= 1
        self.turn_done(turn)

    def turn_done(self, turn: Turn) -> None:
        """After a turn's steps are queued: `X-Session-Done` closes its session (the close is
        queued behind the steps, so the last turn is stored first)."""
        if turn.done:
            self.spawn(self.close_session(turn.tenant, turn.session_id, None, "done"))

    async def close_session(self, tenant: str, session_id: str, outcome: float | None, reason: str) -> bool:
        was_open = await asyncio.to_thread(self.pool.close_session, session_id, outcome, tenant=tenant, reason=reason)
        self.sessions.forget(tenant, session_id)
        return was_open

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background gateway task failed: %r", task.exception())

    def restore_sessions(self, limit: int = 1000) -> int:
        """After a restart: the matcher re-learns the last turn of each recently active open
        session, so a stock client's conversation continues in its session. Returns how many."""
        cutoff = time.time() - self.config.gateway.session_idle_s
        restored = 0
        for session in self.pool.sessions(limit=limit):
            if session["status"] != "open" or session["updated_at"] < cutoff:
                continue
            turns = self.pool.show(session["session_id"], session["tenant"])["steps"]
            mains = [t for t in turns if t["turn_type"] == "main"]
            if mains:
                [step] = self.pool.get_steps([mains[-1]["step_id"]])
                reply = schema.message_of(self.engine.parse(step.text))
                self.sessions.restore(step.tenant, step.session_id, step.messages, reply, turns[-1]["turn_index"] + 1)
                restored += 1
        return restored

    async def watch_adapters(self) -> None:
        """Serve each newly published version of each adapter (the shared policy, or every
        tenant's): the engine loads it beside the old one and flips the name atomically, so
        in-flight requests finish on their version and nothing fails. A version that does not load
        is logged once and skipped."""
        root = Path(self.config.data_dir) / ("weights" if self.full else "adapters")
        skipped: set[tuple[str, int]] = set()
        while True:
            await asyncio.sleep(self.config.gateway.adapter_poll_s)
            for name in await asyncio.to_thread(self._adapter_names, root):
                newest = await asyncio.to_thread(adapters.latest, root, name)
                serving = self.engine.weights_version() if self.full else self.engine.adapters().get(name, -1)
                if newest is None or (name, newest[0]) in skipped or newest[0] <= serving:
                    continue
                started = time.perf_counter()
                try:
                    if self.full:  # the engine drains its batch, swaps every weight, resumes
                        await self.engine.load_weights(newest[1])
                    else:
                        await self.engine.load_adapter(name, newest[1])
                except EngineError as exc:
                    skipped.add((name, newest[0]))
                    log.error("%s v%d at %s was not loaded: %s", name, newest[0], newest[1], exc)
                    continue
                self.swaps.append((time.time(), name, newest[0], time.perf_counter() - started))
                log.info("serving %s v%d (loaded in %.0f ms)", name, newest[0], 1000 * (time.perf_counter() - started))

    def _adapter_names(self, root: Path) -> list[str]:
        if not self.per_tenant:  # the shared policy (an adapter, or under full fine-tuning whole weights)
            return [POLICY]
        prefix = adapter_name("")  # "policy-"
        return sorted(d.name for d in root.iterdir() if d.name.startswith(prefix)) if root.is_dir() else []

    async def sweep_idle(self) -> None:
        """Close sessions idle for `session_idle_s` (those with a request in flight are kept)."""
        idle = self.config.gateway.session_idle_s
        while True:
            await asyncio.sleep(min(max(idle / 4, 0.05), 30.0))
            keep = self.sessions.active_since(time.monotonic() - idle)
            try:
                closed = await asyncio.to_thread(self.pool.close_idle, idle, keep)
            except Exception:  # a busy database must not end the sweeper: the next round retries
                log.exception("closing idle sessions failed; retrying next round")
                continue
            for tenant, session_id in closed:
                self.sessions.forget(tenant, session_id)


async def _all_final(streams: list[GenerationStream]) -> list[Generation]:
    return list(await asyncio.gather(*[s.final() for s in streams]))


def _listed(result: Generation | list[Generation]) -> list[Generation]:
    return result if isinstance(result, list) else [result]


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so only `http.disconnect` is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _log_failure(future: Any, step_id: str) -> None:
    if future.exception() is not None:
        log.error("recording %s failed: %s", step_id, future.exception())


def create_app(engine: Engine, pool: DataPool, config: Config) -> FastAPI:
    from clawr1.gateway import anthropic, chat, completions, dashboard, lifecycle, responses

    gateway = Gateway(engine, pool, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        restored = await asyncio.to_thread(gateway.restore_sessions)
        if restored:
            log.info("restored %d open sessions for history matching", restored)
        background = [asyncio.create_task(gateway.sweep_idle()), asyncio.create_task(gateway.watch_adapters())]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, *gateway._tasks, return_exceptions=True)

    app = FastAPI(title="Claw-R1 gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    app.state.trainer_logs = {}  # the dashboard's view of the trainer: a MetricsTail per trained adapter
    errors.install(app)
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "adapters": engine.adapters()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        caller = gateway.authenticate(request)
        mine = gateway.adapter_of(caller.tenant)  # a tenant never learns of another's adapter
        ids = [config.engine.model] + [name for name in sorted(engine.adapters()) if name == mine]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "clawr1"} for i in ids]}

    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(lifecycle.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.include_router(metrics_router)
    app.include_router(dashboard.router)
    return app
