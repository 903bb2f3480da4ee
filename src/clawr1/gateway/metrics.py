"""`GET /metrics`: the gateway's operational numbers in Prometheus' text format.

One `CollectorRegistry` per app, not the process-global one: tests (and a process that builds a
second app) would otherwise collide on the metric names. The hot path stays cheap: a request pays
one pure-ASGI wrapper (not Starlette's BaseHTTPMiddleware, which pipes every response through a
stream), one counter and one histogram sample on label children cached per (route, status); a
recorded generation pays three increments; a stream's first token one histogram sample. Labels are
route templates, status codes and finish reasons, never session ids or paths as sent, so the number
of series is bounded by the routes. Levels (queues, READY samples, the served version, swaps, judge
outcomes) are read when scraped, never tracked per request.

Auth: operational data, so `gateway.admin_key` is required when one is set; else one of
`gateway.api_keys` when those are set; with no keys at all it is open (the gateway then binds
loopback only). Per-session keys never read it.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from clawr1.core.records import DEFAULT_TENANT, POLICY
from clawr1.core.types import Generation, TokenEvent
from clawr1.gateway.errors import APIError

if TYPE_CHECKING:
    from clawr1.core.config import Config
    from clawr1.datapool.base import DataPool
    from clawr1.engine.base import Engine, GenerationStream
    from clawr1.gateway.sessions import SessionResolver
    from clawr1.gateway.throttle import Throttle
    from clawr1.reward.worker import RewardWorker

# From a fake backend's ~1 ms to a CPU model's minutes-long reply.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
UNMATCHED = "unmatched"  # requests no route matched share one label, whatever path they named

router = APIRouter()


class Observed(Protocol):
    """What the metrics read of the gateway, when scraped and to authorize a scrape (`Gateway` of
    `service.py` is one). Named here, not imported: the service builds its `GatewayMetrics`, so an
    import back would close a circle."""

    config: Config
    pool: DataPool
    engine: Engine
    sessions: SessionResolver
    throttle: Throttle
    swaps: list[tuple[float, str, int, float]]  # (when, adapter, version, load seconds)
    agent_keys: list[tuple[bytes, str]]  # (key, tenant)
    guard: Any  # the `Guard`, when it runs
    metrics: GatewayMetrics

    @property
    def pending(self) -> int: ...

    def served_version(self, tenant: str = DEFAULT_TENANT) -> int: ...

    def serving_behind(self) -> dict[str, int]: ...


class GatewayMetrics:
    """The metrics of one gateway: counters updated as requests are served, levels read at scrape."""

    def __init__(self, gateway: Observed):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("clawr1_requests", "HTTP requests answered, by route template and status code",
                                ["route", "status"], registry=r)
        self.duration = Histogram("clawr1_request_duration_seconds", "Time from a request's arrival to the "
                                  "last byte of its response (streams included)", ["route"], buckets=BUCKETS,
                                  registry=r)
        self.ttft = Histogram("clawr1_time_to_first_token_seconds", "Time from admission to a generation's "
                              "first sampled token (engine queue + prefill), streamed or not", buckets=BUCKETS,
                              registry=r)
        self.prompt_tokens = Counter("clawr1_prompt_tokens", "Prompt tokens of finished generations (each of "
                                     "n choices counts its prompt: each is prefilled)", registry=r)
        self.completion_tokens = Counter("clawr1_completion_tokens", "Tokens sampled by finished generations",
                                         registry=r)
        self.generations = Counter("clawr1_generations", "Finished generations handed to the pool, by finish "
                                   "reason (aborted: client gone or timed out)", ["finish_reason"], registry=r)
        self.ready = Gauge("clawr1_pool_ready_samples", "READY samples waiting for the trainer", registry=r)
        self.trained = Gauge("clawr1_trained_version", "The newest trained version of the shared policy, what "
                             "it learned from: samples; no_signal (samples with neither a reward nor a hint); "
                             "kl_silent (1: a KL term configured but 0); lost_<why> (turns that left training "
                             "unused since the version before: masked, stale, poison, judge)", ["measure"],
                             registry=r)
        self.ready_age = Gauge("clawr1_pool_oldest_ready_age_seconds", "How long the oldest READY sample has "
                               "waited (0 when none)", registry=r)
        self.memory_prompts = Counter("clawr1_memory_prompts", "Prompts a user's memory entries were added to "
                                      "(`clawr1/core/memory.py`)", registry=r)
        self.memory_entries_added = Counter("clawr1_memory_entries_added", "Memory entries added to prompts (each "
                                            "counts once per prompt that got it)", registry=r)
        self.memory_active = Gauge("clawr1_memory_active_entries", "Active memory entries this gateway holds, all "
                                   "users", registry=r)
        self.memory_active.set_function(lambda: memory.active() if (memory := getattr(gateway, "memory", None)) else 0)
        self.judges: list[RewardWorker] = []
        r.register(_Levels(gateway, self.judges))
        self._requests: dict[tuple[str, int], tuple[Any, Any]] = {}  # cached label children
        self._finished: dict[str, Any] = {}

    def watch_judge(self, worker: RewardWorker) -> None:
        """Export this reward worker's outcomes (it runs beside the gateway under `clawr1 up`)."""
        self.judges.append(worker)

    def request_done(self, route: str, status: int, seconds: float) -> None:
        children = self._requests.get((route, status))
        if children is None:
            children = self._requests[route, status] = (self.requests.labels(route, str(status)),
                                                        self.duration.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def memory_recalled(self, entries: int) -> None:
        """A prompt got `entries` memory entries of its user."""
        self.memory_prompts.inc()
        self.memory_entries_added.inc(entries)

    def generation_done(self, gen: Generation) -> None:
        reason = gen.finish_reason or "aborted"
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = self.generations.labels(reason)
        child.inc()
        self.prompt_tokens.inc(len(gen.prompt_ids))
        self.completion_tokens.inc(len(gen.token_ids))

    def timed(self, stream: GenerationStream) -> TimedStream:
        return TimedStream(stream, self.ttft, time.perf_counter())

    def refresh_pool(self, pool: DataPool) -> None:
        """The pool's levels that need a read (called off the event loop, once per scrape)."""
        count, oldest = pool.ready_state()
        self.ready.set(count)
        self.ready_age.set(0.0 if oldest is None else max(0.0, time.time() - oldest))
        trained = pool.trained_versions(POLICY)
        if trained:  # the newest version's silent failures (the trainer's row; `trainer/loop.py`)
            newest = trained[-1]
            for key in ("samples", "no_signal", "kl_silent", *(k for k in newest if k.startswith("lost_"))):
                if isinstance(newest.get(key), (int, float)):
                    self.trained.labels(key).set(newest[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Levels(Collector):
    """Read at scrape time from the gateway and the reward workers: nothing per request."""

    def __init__(self, gateway: Observed, judges: list[RewardWorker]):
        self.gateway, self.judges = gateway, judges

    def collect(self) -> Iterator[Metric]:
        gw = self.gateway
        yield GaugeMetricFamily("clawr1_gateway_inflight", "Generations admitted and not yet handed to the pool "
                                "(waiting in the engine queue, decoding, or being recorded)", value=gw.pending)
        yield GaugeMetricFamily("clawr1_pool_pending_writes", "Pool writes queued and not yet committed",
                                value=gw.pool.pending_writes())
        yield GaugeMetricFamily("clawr1_policy_version", "Policy version new requests are served by "
                                "(0: the base model)", value=gw.served_version())
        yield CounterMetricFamily("clawr1_policy_swaps", "Published policy versions loaded and swapped in",
                                  value=len(gw.swaps))
        behind = GaugeMetricFamily("clawr1_serving_behind", "Versions what this process serves is behind what was "
                                   "decided for it (a gateway worker that could not load what the leader serves, "
                                   "full weights that did not load): an older version or the base served instead, "
                                   "with no request failing", labels=["adapter"])
        for name, n in sorted(gw.serving_behind().items()):
            behind.add_metric([name], n)
        yield behind
        turns = CounterMetricFamily("clawr1_session_turns", "Turns by how their session was found: path, header, "
                                    "key (named by the client); matched, edited (its last reply resent as the client "
                                    "edited it), compacted (history matching); new (no history); unmatched (history no "
                                    "open session held: a conversation split in two)", labels=["how"])
        for how, count in gw.sessions.turns_by_how().items():
            turns.add_metric([how], count)
        yield turns
        counts = getattr(gw.engine, "stats", None)  # the local engine's own counters (a remote one has its own)
        if isinstance(counts, collections.Counter):
            yield CounterMetricFamily("clawr1_engine_prefill_tokens", "Prompt tokens the local engine ran through "
                                      "the model", value=counts["prefill_tokens"])
            yield CounterMetricFamily("clawr1_engine_prefix_cached_tokens", "Prompt tokens the local engine took "
                                      "from its prefix cache instead (an agent's resent conversation)",
                                      value=counts["prefix_cached_tokens"])
            yield CounterMetricFamily("clawr1_engine_prefix_rewarmed_tokens", "Prompt tokens the local engine "
                                      "prefilled again in idle time under new weights (engine.prefix_rewarm)",
                                      value=counts["prefix_rewarmed_tokens"])
        yield CounterMetricFamily("clawr1_policy_swap_load_seconds", "Time spent loading swapped-in versions",
                                  value=sum(swap[-1] for swap in gw.swaps))
        outcomes: collections.Counter[tuple[int, str]] = collections.Counter()
        counts: collections.Counter[str] = collections.Counter()
        for worker in self.judges:
            outcomes.update(worker.outcomes)
            counts.update(worker.counts)
        judged = CounterMetricFamily("clawr1_judge_outcomes", "Turns the reward worker judged, by score and "
                                     "by who decided (rule, judge, classifier)", labels=["score", "source"])
        for (score, source), n in sorted(outcomes.items()):
            judged.add_metric([str(score), source], n)
        yield judged
        hints = CounterMetricFamily("clawr1_judge_hints", "Hint extraction results: accepted, or why none",
                                    labels=["result"])
        hints.add_metric(["accepted"], counts["hints"])
        for key, n in sorted(counts.items()):
            if key.startswith("no_hint_"):
                hints.add_metric([key.removeprefix("no_hint_")], n)
        yield hints
        yield CounterMetricFamily("clawr1_judge_errors", "Judge calls that failed (retried later)",
                                  value=counts["judge_errors"])
        yield from _guard(gw.guard)


def _guard(guard: Any) -> Iterator[Metric]:
    """The guard's decisions and the probe quality of what each adapter serves (its verdict's
    scores: sane rate, relevance, fluency, KL from the base, entropy), beside the base's own."""
    if guard is None:
        return
    decisions = CounterMetricFamily("clawr1_guard_decisions", "Candidate versions the guard decided on",
                                    labels=["decision"])
    for decision, n in sorted(guard.decisions.items()):
        decisions.add_metric([decision], n)
    yield decisions
    in_a_row = GaugeMetricFamily("clawr1_guard_rejected_in_a_row", "Candidates rejected since the adapter's "
                                 "last promotion (a loop that stops learning shows here)", labels=["adapter"])
    for name, n in sorted(guard.rejected_in_a_row.items()):
        in_a_row.add_metric([name], n)
    yield in_a_row
    quality = GaugeMetricFamily("clawr1_served_quality", "Probe-set quality of the served version (who=served) "
                                "and of the base model on the same probes (who=base)",
                                labels=["adapter", "who", "measure"])
    for line in guard.lines.values():
        if line.probes is None:
            continue
        served = line.probes.summaries.get(line.served, line.probes.base if line.served == 0 else None)
        for who, summary in (("served", served), ("base", line.probes.base)):
            for measure in ("sane_rate", "relevance", "fluency", "repetition", "kl", "entropy"):
                value = getattr(summary, measure, None) if summary is not None else None
                if value is not None:
                    quality.add_metric([line.name, who, measure], value)
    yield quality


class TimedStream:
    """A GenerationStream that times its first token. Until then `__anext__` goes through one extra
    coroutine; after it every call is handed straight to the engine's stream."""

    __slots__ = ("_inner", "_since", "_ttft")

    def __init__(self, inner: GenerationStream, ttft: Histogram, since: float):
        self._inner, self._ttft, self._since = inner, ttft, since

    @property
    def version(self) -> int:
        return self._inner.version  # read through: an engine may settle it when it admits the request

    def __aiter__(self) -> TimedStream:
        return self

    def __anext__(self) -> Any:
        if self._since is None:
            return self._inner.__anext__()
        return self._first()

    async def _first(self) -> TokenEvent:
        event = await self._inner.__anext__()
        self._ttft.observe(time.perf_counter() - self._since)
        self._since = None
        return event

    async def final(self) -> Generation:
        if self._since is not None:
            try:
                await self._first()
            except StopAsyncIteration:  # ended (cancelled) before any token: there is nothing to time
                pass
        return await self._inner.final()

    def cancel(self) -> None:
        self._inner.cancel()

    def ready(self) -> bool:
        ready = getattr(self._inner, "ready", None)  # optional in the engine contract
        return ready is not None and ready()


class MetricsMiddleware:
    """Counts every HTTP request by route template and status, and times it to its last byte."""

    def __init__(self, app: Any, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception that escapes the app is answered 500 by the outermost layer

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")  # set by the router when a route matched: its template
            self.metrics.request_done(route.path if route is not None else UNMATCHED, status,
                                      time.perf_counter() - started)


def authorize(gw: Observed, request: Request) -> None:
    """The admin key when one is set, else a key of the default tenant (`gateway.api_keys`) when
    agent keys are set, else open (loopback). Never another tenant's key: the exposition is every
    tenant's (their adapters' names and quality), and a tenant never learns of another's adapter."""
    admin = gw.config.gateway.admin_key
    if admin is None and not gw.agent_keys:
        return
    allowed = ([admin.encode()] if admin is not None
               else [key for key, owner in gw.agent_keys if owner == DEFAULT_TENANT])
    auth = request.headers.get("authorization", "")
    token = (auth[7:].strip() if auth.startswith("Bearer ") else "").encode()
    client = request.client.host if request.client else None  # (`service.client_of`: service imports this module)
    if gw.throttle.blocked:
        gw.throttle.check(client)
    if not any(hmac.compare_digest(token, key) for key in allowed):
        gw.throttle.failed(client)
        which = "the admin key" if admin is not None else "a key of gateway.api_keys (or set gateway.admin_key)"
        raise APIError(401, f"/metrics needs {which} (Authorization: Bearer <key>)", code="invalid_api_key")


# The same from every process (read from the one pool).
POOL_LEVELS = ("clawr1_pool_ready_samples", "clawr1_pool_oldest_ready_age_seconds", "clawr1_trained_version")


def merge_workers(texts: list[str]) -> bytes:
    """The expositions of the `gateway.workers` processes as one (what the front answers `GET
    /metrics` with): every sample labelled with its `worker`, so sums and rates over them are the
    gateway's; the pool's levels, which every process reads from the one pool, once, unlabelled."""
    families: dict[str, Metric] = {}
    for i, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            shared = family.name in POOL_LEVELS
            if shared and i > 0:
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            merged.samples += [s if shared else s._replace(labels={**s.labels, "worker": str(i)})
                               for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw: Observed = request.app.state.gateway
    authorize(gw, request)
    await asyncio.to_thread(gw.metrics.refresh_pool, gw.pool)
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)
