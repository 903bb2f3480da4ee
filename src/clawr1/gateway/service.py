"""The serving layer every route shares: auth, admission, versions, session closing, and the
gateway's background jobs (idle sweep, adapter watcher). Routes import this module and
`pipeline.py`; `app.py` only assembles them.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from fastapi import Request
from pydantic import BaseModel

from clawr1.core import memory as memory_rules
from clawr1.core.config import Config
from clawr1.core.records import DEFAULT_TENANT, POLICY, adapter_name
from clawr1.core.types import EngineError
from clawr1.datapool.base import DataPool, UnknownStepError
from clawr1.engine import adapters
from clawr1.engine.base import Engine
from clawr1.engine.remote import RemoteEngine
from clawr1.gateway import dispatch, schema
from clawr1.gateway.body import read_json
from clawr1.gateway.errors import APIError, validate
from clawr1.gateway.memory import Memory
from clawr1.gateway.metrics import GatewayMetrics
from clawr1.gateway.sessions import (
    AGENT_KEY_PREFIX,
    SESSION_KEY_PREFIXES,
    UNKNOWN_SESSION_KEY,
    SessionResolver,
    Turn,
    hash_key,
    new_session_key,
)
from clawr1.gateway.throttle import Throttle
from clawr1.quality import QualityMeter

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)



KEY_CACHE = 65_536
WEIGHTS = "(weights)"  # `serving_behind`'s name for the whole weights (full fine-tuning): no adapter's name
"""Per-session keys remembered, known and unknown each (least recently used dropped first): a
known one then costs no pool read, an unknown one (a guess) one read, not one a request."""


class Caller(NamedTuple):
    tenant: str
    session_id: str | None  # set when the request came with a per-session key
    rates: bool = True  # False for an agent's session key: it serves its session and cannot rate it


def client_of(request: Request) -> str | None:
    """The client's address (behind the front, the one it forwarded)."""
    client = request.scope.get("client")
    return client[0] if client else None


class Ticket:
    """Room for `n` steps, from admission until their writes are handed to the pool. Released
    once, by whoever ends the request (`pipeline.Exchange`); releasing again is a no-op."""

    __slots__ = ("_owner", "n", "tenant")

    def __init__(self, owner: Admission, n: int, tenant: str):
        self._owner, self.n, self.tenant = owner, n, tenant

    def release(self) -> None:
        if self.n:
            self._owner.inflight -= self.n
            held = self._owner.held
            held[self.tenant] -= self.n
            if not held[self.tenant]:
                del held[self.tenant]
            self.n = 0


class Admission:
    """The one owner of the in-flight count (`clawr1_gateway_inflight`). Only a `Ticket` changes
    it, so no path (an error, a disconnect, a bug) can leave a slot taken: the pipeline releases
    its ticket in a `finally` that every path passes through.

    It also refuses (503 `pool_unavailable`) every request while the pool cannot write
    (`DataPool.write_error`: disk full, I/O error): with `durable_reply` off a reply goes out before
    its step is committed, so admitting would answer 200 and lose the step. Recovery is half-open:
    while refusing, a probe runs `check_writable` (a tiny committed write, in a thread) at most every
    `recheck_s`, with or without traffic; the first that succeeds clears the error, so the gateway
    admits again by itself a few seconds after the disk has room.

    With named tenants (`tenants.keys`) each may hold at most `gateway.tenant_share` of the slots,
    so one tenant's burst (or streams it never reads) leaves room for the others."""

    recheck_s: float = 2.0
    """Seconds between two probes of a pool that cannot write (each one tiny write and an fsync)."""

    def __init__(self, config: Config, pool: DataPool):
        self.max_pending, self.queue_room = config.gateway.max_pending, config.pool.writer_queue
        self.pool = pool
        self.inflight = 0
        self.held: dict[str, int] = {}  # slots each tenant holds (tenants with none are not there)
        shared = bool(config.tenants.keys) and config.gateway.tenant_share < 1
        self.per_tenant = max(1, int(self.max_pending * config.gateway.tenant_share)) if shared else self.max_pending
        self._probe: asyncio.Task | None = None  # the half-open probe, while the pool cannot write
        self._next_probe = 0.0  # monotonic time the next probe may run (kept across outages)

    @property
    def most(self) -> int:
        """The largest ticket a tenant can ever get."""
        return min(self.max_pending, self.queue_room, self.per_tenant)

    def acquire(self, steps: int, tenant: str) -> Ticket:
        """Shed load before anything could be lost: 503 while the pool cannot write; and the
        requests in flight plus the pool's queue must have room for this request's steps, and the
        tenant its share, else 429."""
        error = self.pool.write_error()
        if error is not None:
            self._start_probe(error)
            # The pool's own words (paths, the database's message) go to the log, not to a client.
            raise APIError(503, "the data pool cannot store new steps; nothing was run, retry shortly",
                           code="pool_unavailable")
        if steps > self.most:  # could never be admitted: retrying cannot help
            raise APIError(400, f"this request makes {steps} generations (prompts x n); the gateway admits at most "
                                f"{self.most} at once (gateway.max_pending, gateway.tenant_share, "
                                "pool.writer_queue)", param="n", code="invalid_value")
        if self.inflight + steps > self.max_pending:
            raise APIError(429, f"{self.inflight} requests are being served or recorded; retry shortly",
                           code="rate_limit_exceeded")
        held = self.held.get(tenant, 0)
        if held + steps > self.per_tenant:
            raise APIError(429, f"this tenant has {held} requests being served or recorded, its share of the "
                                "gateway (gateway.tenant_share); retry shortly", code="rate_limit_exceeded")
        queued = self.pool.pending_writes()
        if queued + self.inflight + steps > self.queue_room:
            raise APIError(429, f"the data pool is behind ({queued} writes queued); retry shortly",
                           code="rate_limit_exceeded")
        self.inflight += steps
        self.held[tenant] = held + steps
        return Ticket(self, steps, tenant)

    def _start_probe(self, error: str) -> None:
        """Run the half-open probe unless it runs already (called on the event loop, by a request)."""
        if self._probe is None or self._probe.done():
            log.error("refusing requests (503) until the data pool can write again: %s", error)
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_writable())
            self._probe.add_done_callback(self._probe_done)

    async def _probe_until_writable(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._next_probe - time.monotonic()))
            self._next_probe = time.monotonic() + self.recheck_s
            why = await asyncio.to_thread(self.pool.check_writable)
            if why is None:
                log.warning("the data pool can write again; admitting requests")
                return
            log.debug("the data pool still cannot write: %s", why)

    @staticmethod
    def _probe_done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # the next refused request starts another
            log.error("the data pool's writability probe failed: %r", task.exception())


class Gateway:
    def __init__(self, engine: Engine, pool: DataPool, config: Config, worker: int = 0,
                 internal_key: str | None = None):
        """`worker`: this process's index among `gateway.workers` (0, the leader, decides which
        versions serve; the others follow it: `watch_versions`); `internal_key`: the front
        processes' key for `/internal/match`."""
        self.engine, self.pool, self.config = engine, pool, config
        self.worker, self.workers = worker, config.gateway.workers
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} of {self.workers}")
        owns = (lambda session_id: dispatch.owner(session_id, self.workers) == worker) if self.workers > 1 else None
        self.sessions = SessionResolver(pool.last_turn, owns)
        self.admission = Admission(config, pool)
        # Per-session keys seen: sha256 -> (tenant, session id, rates), and those the pool does not
        # know (a key is random: one unknown now is never issued later). Both bounded (`KEY_CACHE`).
        self._session_keys: OrderedDict[str, tuple[str, str, bool]] = OrderedDict()
        self._unknown_keys: OrderedDict[str, None] = OrderedDict()
        self.throttle = Throttle(config.gateway.auth_failures_per_minute)
        self._tasks: set[asyncio.Task] = set()  # background closes and settles, referenced until done
        self.swaps: list[tuple[float, str, int, float]] = []  # (when, adapter, version, load seconds)
        # What this process should serve but may not have loaded (`serving_behind`): the leader's
        # choice per adapter for a follower; the newest published whole weights under full fine-tuning.
        self.decided: dict[str, int] = {}
        self.metrics = GatewayMetrics(self)  # `GET /metrics`; reads the fields above when scraped
        # Each user's memory entries, kept current from the pool (`Memory.watch`), added to prompts.
        self.memory = Memory(config, pool, engine, self.metrics.memory_recalled)
        # Every agent key with its tenant: `gateway.api_keys` are the default tenant's.
        self.agent_keys = [(key.encode(), DEFAULT_TENANT) for key in config.gateway.api_keys] + [
            (key.encode(), tenant) for tenant, keys in config.tenants.keys.items() for key in keys]
        self.per_tenant = config.tenants.adapter_per_tenant
        self.full = config.trainer.finetune == "full"  # versions are whole weights, not adapters
        self._meter: QualityMeter | None = None
        # What a request that names no sampling settings gets: the model's recommended ones (its
        # generation config, as vLLM applies them), each overridable in config (`engine.temperature` ...).
        set_ = config.engine
        self.sampling_defaults = engine.sampling_defaults.overridden(set_.temperature, set_.top_p, set_.top_k)
        self.usage: dict[str, int] = {}  # each tenant's stored bytes, as the pool last said (`watch_usage`)
        self.guard: Any = None  # the `Guard`, when it runs (`watch_versions`)
        self.internal_key = internal_key

    async def quality_meter(self) -> QualityMeter:
        """The quality measure (`clawr1.quality`) on this gateway's engine, loaded on first use (the
        embedder takes ~2 s; a gateway nobody asks about quality never loads it)."""
        if self._meter is None:
            meter = await asyncio.to_thread(QualityMeter.load, self.engine)
            self._meter = self._meter or meter
        return self._meter

    @property
    def pending(self) -> int:
        """Steps admitted whose writes are not yet handed to the pool."""
        return self.admission.inflight

    async def read(self, request: Request, model: type[M]) -> M:
        """A request body as `model`: size and depth bounded before parsing, then validated (400)."""
        config = self.config.gateway
        return validate(model, await read_json(request, config.max_body_bytes, config.max_json_depth))

    # ---- auth ------------------------------------------------------------------------------
    async def authenticate(self, request: Request) -> Caller:
        """Agent keys (`gateway.api_keys`) or a per-session key; none needed when no keys are set
        (the gateway then only binds to loopback). A per-session key binds the request to its
        session; an unknown one is refused even without agent keys, so it never lands elsewhere."""
        auth = request.headers.get("authorization", "")
        return await self.caller(auth[7:].strip() if auth.startswith("Bearer ") else "", client_of(request))

    async def caller(self, token: str, client: str | None = None) -> Caller:
        """`authenticate` for a key taken from elsewhere (the Anthropic route reads `x-api-key`). A
        per-session key not seen yet is looked up in the pool off the event loop (the pool may be a
        server or a Ray actor, and its reads queue behind one lock). A failed check counts against
        `client` (`Throttle`); a blocked client is refused whatever it sends."""
        if self.throttle.blocked:
            self.throttle.check(client)
        if token.startswith(SESSION_KEY_PREFIXES):
            bound = await self._session_for_key(token)
            if bound is None:
                self.throttle.failed(client)
                raise APIError(401, UNKNOWN_SESSION_KEY, code="invalid_api_key")
            return Caller(*bound)
        if not self.agent_keys:
            return Caller(DEFAULT_TENANT, None)
        given = token.encode()
        tenant = None
        for key, owner in self.agent_keys:  # compare with every key: the time says nothing of which matched
            if hmac.compare_digest(given, key):
                tenant = owner
        if tenant is None:
            self.throttle.failed(client)
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return Caller(tenant, None)

    async def resolve(self, caller: Caller, messages: list[dict[str, Any]], headers: dict[str, str],
                      path_ids: tuple[str, str] | None) -> Turn:
        """The request's session turn (`SessionResolver`), reading the pool only for a session this
        process has not seen, and then in a thread."""
        who = self.sessions.identify(caller.tenant, messages, headers, path_ids, caller.session_id)
        last = None
        if self.sessions.needs_lookup(who):
            last = await asyncio.to_thread(self.pool.last_turn, who.session_id, who.tenant)
        return self.sessions.number(who, last)

    async def _session_for_key(self, token: str) -> tuple[str, str, bool] | None:
        """(tenant, session id, rates) of a per-session key, or None: from the caches, else from
        the pool (keys outlive restarts: they are there), in a thread."""
        digest = hash_key(token)
        bound = self._session_keys.get(digest)
        if bound is not None:
            self._session_keys.move_to_end(digest)
            return bound
        if digest in self._unknown_keys:
            self._unknown_keys.move_to_end(digest)
            return None
        found = await asyncio.to_thread(self.pool.session_by_key, digest)
        if found is None:
            _remember(self._unknown_keys, digest, None)
            return None
        bound = (found[0], found[1], not token.startswith(AGENT_KEY_PREFIX))
        _remember(self._session_keys, digest, bound)
        return bound

    def new_session_key(self, session_id: str, rates: bool = True) -> tuple[str, str]:
        """A fresh per-session key for `session_id` and its sha256 (`sessions.new_session_key`;
        `rates` False: an agent's key, which cannot rate its session); with `gateway.workers`, one
        that routes where the session's id does, so requests naming the session and requests with
        its key reach the same process."""
        key, digest = new_session_key(rates)
        while dispatch.owner(key, self.workers) != dispatch.owner(session_id, self.workers):
            key, digest = new_session_key(rates)
        return key, digest

    def remember_session_key(self, digest: str, tenant: str, session_id: str, rates: bool = True) -> None:
        self._unknown_keys.pop(digest, None)
        _remember(self._session_keys, digest, (tenant, session_id, rates))

    def is_admin(self, request: Request) -> bool:
        """The request carries the admin key (`Authorization: Bearer <admin_key>`)."""
        admin = self.config.gateway.admin_key
        auth = request.headers.get("authorization", "")
        return admin is not None and auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].strip().encode(),
                                                                                          admin.encode())

    async def check_completion_session(self, tenant: str, session_id: str, completion_id: str) -> None:
        """A per-session caller names only its own session's completions (its first choice
        tells); another's raises UnknownStepError, as an id that does not exist would."""
        [first] = await asyncio.to_thread(self.pool.get_steps, [f"{completion_id}-0"])
        if (first.tenant, first.session_id) != (tenant, session_id):
            raise UnknownStepError(completion_id)

    def require_admin(self, request: Request) -> None:
        if self.config.gateway.admin_key is None:
            raise APIError(403, "admin routes are disabled: set gateway.admin_key", code="admin_disabled")
        client = client_of(request)
        if self.throttle.blocked:
            self.throttle.check(client)
        if not self.is_admin(request):
            self.throttle.failed(client)
            raise APIError(401, "admin routes need the admin key (Authorization: Bearer <admin_key>)",
                           code="invalid_api_key")

    # ---- versions --------------------------------------------------------------------------
    def adapter_of(self, tenant: str) -> str:
        """The adapter a tenant is served: its own with per-tenant adapters, else the shared one."""
        return adapter_name(tenant if self.per_tenant else None)

    def served_adapter(self, tenant: str) -> str | None:
        """The engine adapter a tenant's new request gets, or None (the base model)."""
        name = self.adapter_of(tenant)
        return name if name in self.engine.adapters() else None

    def serving_behind(self) -> dict[str, int]:
        """Per adapter (`WEIGHTS`: the whole weights), how many versions what this process serves
        is behind what was decided for it: a follower that could not load what the leader serves,
        weights that did not load, both serving an older version or the base without failing a
        request. 0 when it serves what was decided."""
        if not self.decided:  # one process serving LoRA versions: what it loaded is what the guard decided
            return {}
        have = {**self.engine.adapters(), WEIGHTS: self.engine.weights_version()}
        return {name: version - have.get(name, 0) for name, version in self.decided.items()}

    def served_version(self, tenant: str = DEFAULT_TENANT) -> int:
        """The policy version a tenant's new requests get (0: the base model)."""
        if self.full:
            return self.engine.weights_version()
        return self.engine.adapters().get(self.adapter_of(tenant), 0)

    # ---- sessions --------------------------------------------------------------------------
    async def close_session(self, tenant: str, session_id: str, outcome: float | None, reason: str) -> bool:
        was_open = await asyncio.to_thread(self.pool.close_session, session_id, outcome, tenant=tenant, reason=reason)
        self.sessions.forget(tenant, session_id)
        return was_open

    def check_storage(self, tenant: str, stored: int) -> None:
        """Refuse a request that would store more than one request may (413), or whose tenant's
        steps have reached its storage quota (429 `insufficient_quota`): one tenant can never fill
        the disk the others' steps go to, and goes past its quota by one request at most. Counted on
        admission, so a burst between two reads of the pool's counts is held back too."""
        limit = self.config.gateway.max_request_store_bytes
        if stored > limit:
            raise APIError(413, f"this request would store {stored:,} bytes (its messages and tools once per "
                                f"generation); the limit is {limit:,} (gateway.max_request_store_bytes): send "
                                "fewer choices (n) or a shorter conversation", code="request_too_large")
        used, quota = self.usage.get(tenant, 0), self.config.tenants.quota_of(tenant)
        if used >= quota:
            raise APIError(429, f"tenant {tenant!r} has {used:,} bytes stored of its quota of {quota:,}; nothing "
                                "was run. An admin can export and move its data, or raise tenants.storage_quota_bytes",
                           type="insufficient_quota", code="storage_quota_exceeded")
        self.usage[tenant] = used + stored

    async def watch_usage(self, every_s: float = 2.0) -> None:
        """Keep `usage` at the pool's counts (every gateway process writing to it counted)."""
        while True:
            try:
                self.usage = await asyncio.to_thread(self.pool.tenant_usage)
            except Exception:  # a busy database must not end the watcher: the next round retries
                log.exception("reading the tenants' storage use failed; retrying")
            await asyncio.sleep(every_s)

    def spawn(self, coro: Any) -> asyncio.Task:
        """Run `coro` as a task the gateway keeps a reference to until it ends; its failure is logged."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background gateway task failed: %r", task.exception())

    def restore_sessions(self, limit: int = 1000) -> int:
        """After a restart: the matcher re-learns the last turn of each recently active open
        session, so a stock client's conversation continues in its session. Returns how many. A
        record it cannot restore is logged and skipped: nothing a tenant stored may stop a start."""
        cutoff = time.time() - self.config.gateway.session_idle_s
        restored = 0
        for session in self.pool.sessions(limit=limit):
            if session["status"] != "open" or session["updated_at"] < cutoff:
                continue
            if self.sessions.owns is not None and not self.sessions.owns(session["session_id"]):
                continue  # another gateway process serves it
            try:
                restored += self._restore(session["tenant"], session["session_id"])
            except Exception as exc:  # noqa: BLE001 - one bad record must not fail start-up; it is logged
                log.warning("session %s/%s not restored: %r", session["tenant"], session["session_id"], exc)
        return restored

    def _restore(self, tenant: str, session_id: str) -> bool:
        turns = self.pool.show(session_id, tenant, "session")["steps"]
        mains = [t for t in turns if t["turn_type"] == "main"]
        if not mains:
            return False
        [step] = self.pool.get_steps([mains[-1]["step_id"]])
        reply = schema.message_of(self.engine.parse(step.text, step.tools))
        # The messages as the client sent them (the matcher's), without the memory the prompt carried.
        messages = memory_rules.without(step.messages, step.memory)
        self.sessions.restore(step.tenant, step.session_id, messages, reply, turns[-1]["turn_index"] + 1)
        return True

    # ---- background jobs -------------------------------------------------------------------
    async def watch_versions(self) -> None:
        """Serve what the trainer publishes: LoRA versions through the guard (which, with
        `guard.enabled = false`, promotes each as published; the admin's rollback and pin work
        either way), whole weights under full fine-tuning as soon as they appear. With
        `gateway.workers` > 1, worker 0 does that and tells the others (`announce`), which follow."""
        if self.worker > 0:
            await self.follow_leader()
        elif self.workers > 1:
            if isinstance(self.engine, RemoteEngine):  # followers may still run requests on a retired one
                self.engine.retire_delay_s = self.config.gateway.request_timeout_s + 4 * self.config.gateway.adapter_poll_s
            await asyncio.gather(self.announce(), self._decide_versions())
        else:
            await self._decide_versions()

    async def _decide_versions(self) -> None:
        if self.full:
            await self.watch_weights()
            return
        from clawr1.guard import Guard

        self.guard = Guard(self)
        await self.guard.run()

    def served_path(self) -> Path:
        """Where the leader writes what it serves, for the other gateway processes."""
        return Path(self.config.data_dir) / "run" / "served.json"

    def _served(self) -> dict[str, Any]:
        root = Path(self.config.data_dir)
        lines = {name: [version, str(adapters.version_dir(root / "adapters", name, version))]
                 for name, version in self.engine.adapters().items() if "@" not in name}  # not a guard candidate
        weights = self.engine.weights_version()
        return {"adapters": lines, "weights": [weights, str(adapters.version_dir(root / "weights", POLICY, weights))]}

    async def announce(self) -> None:
        """The leader (`gateway.workers` > 1): write what it serves each time it changes."""
        path, last = self.served_path(), None
        while True:
            served = self._served()
            if served != last:
                path.parent.mkdir(parents=True, exist_ok=True)
                await asyncio.to_thread(adapters.write_json, path, served)
                last = served
            await asyncio.sleep(self.config.gateway.adapter_poll_s / 2)

    async def follow_leader(self) -> None:
        """A follower: serve what the leader serves (`announce`), so every process answers a tenant
        with the version the guard decided, within one poll. A local engine loads it itself; a
        remote one adopts what the leader loaded on the shared server."""
        path, failed = self.served_path(), None
        while True:
            served = await asyncio.to_thread(adapters.read_json, path)
            if served is not None:
                self.decided = {name: line[0] for name, line in served["adapters"].items()}
                self.decided[WEIGHTS] = served["weights"][0]
            if served is not None and served != failed:
                try:
                    await self._follow(served)
                except (EngineError, OSError) as exc:  # tried again once the leader serves something else
                    failed = served
                    log.error("could not serve what the leader serves (%s): %s", served, exc)
            await asyncio.sleep(self.config.gateway.adapter_poll_s / 2)

    async def _follow(self, served: dict[str, Any]) -> None:
        remote = isinstance(self.engine, RemoteEngine)
        have = self.engine.adapters()
        for name in set(have) | set(served["adapters"]):
            version, where = served["adapters"].get(name, (0, ""))
            if have.get(name, 0) == version:
                continue
            if remote:
                self.engine.adopt(name, version)
            elif version == 0:
                await self.engine.unload_adapter(name)
            else:
                await self.engine.load_adapter(name, Path(where))
            log.info("following the leader: serving %s v%d", name, version)
        version, where = served["weights"]
        if version != self.engine.weights_version():
            if remote:
                self.engine.adopt_weights(version)
            else:
                await self.engine.load_weights(Path(where))

    async def watch_weights(self) -> None:
        """Full fine-tuning: serve each newly published version of the whole weights (the engine
        drains its batch, swaps every weight, resumes). One that does not load is logged once and
        skipped."""
        root = Path(self.config.data_dir) / "weights"
        skipped: set[int] = set()
        while True:
            await asyncio.sleep(self.config.gateway.adapter_poll_s)
            newest = await asyncio.to_thread(adapters.newest, root, POLICY)
            if newest is not None:
                self.decided[WEIGHTS] = newest[0]
            if newest is None or newest[0] in skipped or newest[0] <= self.engine.weights_version():
                continue
            started = time.perf_counter()
            try:
                await self.engine.load_weights(newest[1])
            except (EngineError, OSError) as exc:  # OSError: retired (deleted) while it loaded
                skipped.add(newest[0])
                log.error("weights v%d at %s were not loaded: %s", newest[0], newest[1], exc)
                continue
            self.swaps.append((time.time(), POLICY, newest[0], time.perf_counter() - started))
            log.info("serving weights v%d (loaded in %.0f ms)", newest[0], 1000 * (time.perf_counter() - started))

    async def sweep_idle(self) -> None:
        """Close sessions idle for `session_idle_s` (those with a request in flight are kept)."""
        idle = self.config.gateway.session_idle_s
        while True:
            await asyncio.sleep(min(max(idle / 4, 0.05), 30.0))
            keep = self.sessions.active_since(time.monotonic() - idle)
            try:
                closed = await asyncio.to_thread(self.pool.close_idle, idle, keep, self.sessions.owns)
            except Exception:  # a busy database must not end the sweeper: the next round retries
                log.exception("closing idle sessions failed; retrying next round")
                continue
            for tenant, session_id in closed:
                self.sessions.forget(tenant, session_id)


def _remember(cache: OrderedDict[str, Any], key: str, value: Any) -> None:
    """Put `key` in a bounded cache, dropping the least recently used past `KEY_CACHE`."""
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > KEY_CACHE:
        cache.popitem(last=False)
