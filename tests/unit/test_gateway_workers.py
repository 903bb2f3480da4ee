"""`gateway.workers`: the front's routing rule (every request of a session reaches the worker that
holds it, read from the request alone), the sessions a worker opens named for it, and a follower
serving what the leader serves, on its own engine or on a server they share."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from fastapi.routing import APIRoute
from prometheus_client import generate_latest

from clawr1.core.config import Config, EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.engine.sglang import SGLangEngine
from clawr1.entrypoints.server import in_thread, make_server
from clawr1.gateway.app import create_app
from clawr1.gateway.dispatch import owner, path_session, route
from clawr1.gateway.matcher import SUMMARISER_PROMPTS
from clawr1.gateway.service import Gateway
from clawr1.gateway.sessions import SessionResolver
from tests.conftest import run
from tests.gateway_helpers import wait_for
from tests.unit.test_adapters import make_adapter
from tests.unit.test_compaction import OPENCLAW_SUMMARY, SYSTEM

IDS = {"session_id": "S1", "prompt_id": "P1", "rollout_id": "R1", "attempt_id": "A1", "name": "N1"}


def config(tmp_path, workers: int = 2) -> Config:
    base = Config(data_dir=tmp_path)
    return base.model_copy(update={"gateway": base.gateway.model_copy(update={"workers": workers})})


def test_the_front_reads_every_routes_session_as_the_route_does(engine, tmp_path):
    """Each route of the app, filled with ids: the front finds the session it names (lightning's
    is `rollout:attempt`, as its handler builds it), or none for a route that names none or only
    reads the pool (the dashboard: the leader serves it). A new route shape the front does not
    know fails here."""
    pool = SQLitePool(tmp_path, config(tmp_path).pool)
    try:
        app = create_app(engine, pool, config(tmp_path)).app
        routes = [r for r in _flat(app.routes) if isinstance(r, APIRoute)]
        assert any("/internal/match" == r.path for r in routes)  # a worker's app (workers > 1)
        checked = 0
        for r in routes:
            params = set(r.param_convertors)
            assert params <= set(IDS), r.path
            path = r.path.format(**IDS)
            expected = "R1:A1" if "rollout_id" in params else ("S1" if "session_id" in params else None)
            if path.startswith("/dashboard/"):
                expected = None
            assert path_session(path) == expected, r.path
            checked += bool(params)
            if "prompt_id" in params:  # a trajectory may be named like a fixed route
                for word in ("chat", "rl", "completions", "metrics", "admin"):
                    assert path_session(r.path.format(**{**IDS, "session_id": word})) == word, (r.path, word)
        assert checked >= 20
    finally:
        pool.close()


def _flat(routes):
    """The app's routes, those of included routers too (FastAPI keeps those as routers)."""
    for r in routes:
        inner = getattr(r, "original_router", None)
        yield from _flat(inner.routes) if inner is not None else [r]


def test_a_stock_conversation_stays_on_one_worker_that_names_its_session_for_itself():
    conversations = []
    for c in range(200):
        history = [SYSTEM, {"role": "user", "content": f"conversation {c}"}]
        workers = set()
        for t in range(4):
            workers.add(route("POST", "/v1/chat/completions", {"authorization": "Bearer k"}, {"messages": history},
                              4, t).worker)
            history = [*history, {"role": "assistant", "content": f"reply {t}"}, {"role": "user", "content": f"q {t}"}]
        assert len(workers) == 1  # every turn repeats the first user message
        conversations.append(workers.pop())
    assert set(collections.Counter(conversations)) == {0, 1, 2, 3}  # and conversations spread
    # A client that marks its latest message for caching (Claude Code) moves the marker off the
    # first message after turn one: the route stays.
    marked = [{"role": "user", "content": [{"type": "text", "text": "Fix the bug", "cache_control": {"type": "ephemeral"}},
                                           {"type": "text", "text": " in main.py"}]}]
    later = [{"role": "user", "content": [{"type": "text", "text": "Fix the bug"}, {"type": "text", "text": " in main.py"}]},
             {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}]
    routes = {route("POST", "/v1/messages", {}, {"messages": m}, 8, 0).worker for m in (marked, later)}
    assert len(routes) == 1
    # The worker that opens the session names it so that routing by its id finds that worker too.
    for index in range(4):
        resolver = SessionResolver(lambda session, tenant: None, owns=lambda s, i=index: owner(s, 4) == i)
        ids = {resolver.resolve("default", [{"role": "user", "content": f"new {n}"}], {}).session_id for n in range(20)}
        assert {owner(s, 4) for s in ids} == {index} and len(ids) == 20


def test_a_named_session_routes_by_its_id_and_a_session_key_by_itself():
    def to(path, headers, body=None):
        return route("POST", path, headers, body, 8, 0)

    assert to("/S1/P1/v1/chat/completions", {}).worker == owner("S1", 8)
    assert to("/v1/chat/completions", {"x-session-id": "S1"}, {"messages": []}).worker == owner("S1", 8)
    assert to("/v1/chat/completions", {}, {"session_id": "S1", "messages": []}).worker == owner("S1", 8)
    assert to("/v1/sessions/S1/close", {}).worker == owner("S1", 8)
    key = "sk-clawr1-s-abc"
    assert to("/v1/messages", {"x-api-key": key}, {"messages": [{"role": "user", "content": "x"}]}).worker == owner(key, 8)
    assert to("/v1/feedback", {}, {"reward": 1}).worker == 0  # nothing to hold: the leader
    spread = {route("POST", "/v1/completions", {}, {"prompt": "p"}, 3, n).worker for n in range(3)}
    assert spread == {0, 1, 2}


def test_only_a_compaction_asks_the_workers_who_holds_its_session():
    def chat(messages, workers=2):
        return route("POST", "/v1/chat/completions", {}, {"messages": messages}, workers, 0)

    assert not chat([SYSTEM, {"role": "user", "content": "hi"}]).ask
    compacted = [SYSTEM, {"role": "user", "content": OPENCLAW_SUMMARY}, {"role": "assistant", "content": "B"},
                 {"role": "user", "content": "c"}]
    assert chat(compacted).ask and not chat(compacted, workers=1).ask
    summarising = [{"role": "system", "content": SUMMARISER_PROMPTS[0] + " Summarise."},
                   {"role": "user", "content": "<conversation>...</conversation>"}]
    assert chat(summarising).ask
    anthropic = {"system": [{"type": "text", "text": SUMMARISER_PROMPTS[0]}], "messages": summarising[1:]}
    assert route("POST", "/v1/messages", {}, anthropic, 2, 0).ask


@contextlib.asynccontextmanager
async def clients(url, tiny_model_dir):
    leader = SGLangEngine(tiny_model_dir, EngineConfig(backend="sglang", url=url))
    follower = SGLangEngine(tiny_model_dir, EngineConfig(backend="sglang", url=url))
    try:
        yield leader, follower
    finally:
        await leader.close()
        await follower.close()


def test_a_follower_on_a_shared_server_adopts_the_leaders_version_and_it_stays_loaded_for_it(
        served, tiny_model_dir, tmp_path):
    """The leader loads, the follower only adopts (no second load); when the leader moves on, the
    version it retired stays on the server `retire_delay_s`, so the follower's request on it (one
    poll behind) still runs; then it is unloaded."""
    url, app, _ = served  # a fake SGLang server (its API over the real local engine) two processes share
    pool = SQLitePool(tmp_path, config(tmp_path).pool)

    async def go():
        async with clients(url, tiny_model_dir) as (leader, follower):
            leader.retire_delay_s = 1.0
            v1 = make_adapter(tiny_model_dir, tmp_path, 1, seed=0)
            await leader.load_adapter("policy", v1)
            gw = Gateway(follower, pool, config(tmp_path), worker=1)
            await gw._follow({"adapters": {"policy": [1, str(v1)]}, "weights": [0, ""]})
            assert follower.adapters() == {"policy": 1}
            await leader.load_adapter("policy", make_adapter(tiny_model_dir, tmp_path, 2, seed=1))
            prompt = follower.render([{"role": "user", "content": "Hi"}])
            gen = await follower.generate(prompt, SamplingParams(max_tokens=3), adapter="policy").final()
            assert gen.finish_reason in ("stop", "length") and gen.version == 1  # still on the server
            assert ("unload", "policy@v1") not in calls()
            for _ in range(100):
                if ("unload", "policy@v1") in calls():
                    break
                await asyncio.sleep(0.05)
            assert ("unload", "policy@v1") in calls()  # once the delay is over
        assert calls().count(("load", "policy@v1")) == 1  # the follower never loaded it

    def calls():
        return [(kind, body.get("lora_name")) for kind, body in app.state.requests if kind in ("load", "unload")]

    try:
        asyncio.run(go())
    finally:
        pool.close()


def test_a_follower_with_its_fresh_engine_loads_what_the_leader_serves_and_drops_what_it_stopped(
        fresh_engine, tiny_model_dir, tmp_path):
    pool = SQLitePool(tmp_path, config(tmp_path).pool)
    try:
        gw = Gateway(fresh_engine, pool, config(tmp_path), worker=1)
        v1 = make_adapter(tiny_model_dir, tmp_path, 1, seed=0)
        run(gw._follow({"adapters": {"policy": [1, str(v1)]}, "weights": [0, ""]}))
        assert fresh_engine.adapters() == {"policy": 1}
        run(gw._follow({"adapters": {}, "weights": [0, ""]}))  # the leader went back to the base
        assert fresh_engine.adapters() == {}
    finally:
        pool.close()


def test_a_follower_that_cannot_load_what_the_leader_serves_says_how_far_behind_it_is(
        fresh_engine, tiny_model_dir, tmp_path):
    """The leader moves to v2, which this follower cannot load: it keeps serving v1 (no request
    fails, the error is logged once), and `clawr1_serving_behind` says it is one version behind."""
    from clawr1.engine import adapters
    from clawr1.gateway.service import WEIGHTS

    pool = SQLitePool(tmp_path, config(tmp_path).pool)
    gw = Gateway(fresh_engine, pool, config(tmp_path), worker=1)
    gw.served_path().parent.mkdir(parents=True)

    def lead(version: int, where: str) -> None:
        adapters.write_json(gw.served_path(), {"adapters": {"policy": [version, where]}, "weights": [0, ""]})

    async def go():
        lead(1, str(make_adapter(tiny_model_dir, tmp_path, 1, seed=0)))
        follower = asyncio.create_task(gw.follow_leader())
        try:
            for _ in range(200):
                if fresh_engine.adapters() == {"policy": 1}:
                    break
                await asyncio.sleep(0.05)
            assert gw.serving_behind() == {"policy": 0, WEIGHTS: 0}
            lead(2, str(tmp_path / "not-there"))
            for _ in range(200):
                if gw.serving_behind()["policy"]:
                    break
                await asyncio.sleep(0.05)
            assert gw.serving_behind() == {"policy": 1, WEIGHTS: 0} and fresh_engine.adapters() == {"policy": 1}
            exposition = generate_latest(gw.metrics.registry).decode()
            assert 'clawr1_serving_behind{adapter="policy"} 1.0' in exposition
        finally:
            follower.cancel()

    try:
        run(go())
    finally:
        pool.close()


# ---- the front process, in-process against two echo workers on Unix sockets ----------------------

def echo_app(index: int):
    """A worker that says who it is and what it got (body size, headers)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route as Path_

    async def echo(request):
        body = await request.body()
        return JSONResponse({"worker": index, "bytes": len(body), "headers": dict(request.headers)})

    async def healthz(request):
        return JSONResponse({"ok": True})

    async def metrics(request):
        if "worker" in request.query_params:  # the front passes `?worker=N` on: answer as `echo`
            return await echo(request)
        from starlette.responses import Response

        return Response(METRICS.format(requests=index + 1, pending=10 * index), media_type="text/plain")

    return Starlette(routes=[Path_("/healthz", healthz), Path_("/metrics", metrics),
                             Path_("/{rest:path}", echo, methods=["GET", "POST"])])


METRICS = """# HELP clawr1_requests HTTP requests answered
# TYPE clawr1_requests counter
clawr1_requests_total{{route="/v1/chat/completions",status="200"}} {requests}
# HELP clawr1_pool_pending_writes Pool writes queued
# TYPE clawr1_pool_pending_writes gauge
clawr1_pool_pending_writes {pending}
# HELP clawr1_pool_ready_samples READY samples waiting for the trainer
# TYPE clawr1_pool_ready_samples gauge
clawr1_pool_ready_samples 7
"""


@contextlib.contextmanager
def front_over(tmp_path, workers: int = 2, max_body: int = 8 * 1024 * 1024, refuse_pages: bool = False):
    """A `Front` serving on a free port in a thread of its own, over `workers` echo apps (None for
    one that is down); yields its base URL."""
    import socket
    import threading

    from clawr1.entrypoints.front import Front, serve

    tmp_path.mkdir(parents=True, exist_ok=True)
    sockets = [tmp_path / f"w{i}.sock" for i in range(workers)]
    servers = [make_server(echo_app(i), uds=str(path)) for i, path in enumerate(sockets)]
    with contextlib.ExitStack() as stack:
        for i, server in enumerate(servers):
            stack.enter_context(in_thread(server, server.serve, name=f"echo-{i}", start_timeout_s=30))
        listener = socket.create_server(("127.0.0.1", 0))
        stop, loop, done = None, None, threading.Event()

        def main():
            nonlocal stop, loop

            async def go():
                nonlocal stop, loop
                stop, loop = asyncio.Event(), asyncio.get_running_loop()
                await serve(Front(sockets, max_body, 64, "k", refuse_pages), listener, tmp_path / "ready", None, 30, stop)

            asyncio.run(go())
            done.set()

        thread = threading.Thread(target=main, daemon=True)
        thread.start()
        deadline = 300
        while not (tmp_path / "ready").exists() and deadline:
            deadline -= 1
            threading.Event().wait(0.05)
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}", servers
        finally:
            loop.call_soon_threadsafe(stop.set)
            done.wait(30)


def test_the_front_of_a_gateway_with_no_keys_refuses_web_pages(tmp_path):
    """Behind a front the workers see only the front; it faces the browsers, so it refuses what a
    lone open gateway refuses (`browsers.refusal`), in the route's error shape."""
    import httpx

    with front_over(tmp_path, refuse_pages=True) as (base, _):
        assert httpx.post(f"{base}/v1/chat/completions", json={}).json()["worker"] in (0, 1)
        cross = httpx.post(f"{base}/v1/feedback", content=b"{}", headers={"Origin": "https://evil.example"})
        assert cross.status_code == 403 and cross.json()["error"]["code"] == "cross_site_refused"
        rebound = httpx.get(f"{base}/dashboard", headers={"Host": "evil.example"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        anthropic = httpx.post(f"{base}/v1/messages", json={}, headers={"Sec-Fetch-Site": "cross-site"})
        assert anthropic.status_code == 403 and anthropic.json()["type"] == "error"


def test_the_front_passes_whole_bodies_and_headers_and_says_what_went_wrong_in_the_routes_shape(tmp_path):
    import httpx

    with front_over(tmp_path) as (base, _):
        big = "x" * (3 * 1024 * 1024)  # read past what aiohttp buffers at once
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=30, headers={
            "X-Clawr1-Internal": "forged", "x-CLAWR1-path": "/v1/messages", "X-Session-Id": "s1"},
            json={"messages": [{"role": "user", "content": big}]})
        assert reply.status_code == 200 and reply.json()["worker"] == owner("s1", 2)
        got = reply.json()
        assert got["bytes"] > 3 * 1024 * 1024  # the whole body
        assert "x-clawr1-internal" not in got["headers"] and "x-clawr1-path" not in got["headers"]
        assert got["headers"]["x-session-id"] == "s1"
        # Who the client is and how it came, for the worker (which sees only the front); a client's
        # own claim counts only from a proxy on loopback that sends both, as uvicorn trusts one.
        assert (got["headers"]["x-forwarded-for"], got["headers"]["x-forwarded-proto"]) == ("127.0.0.1", "http")
        claimed = httpx.post(f"{base}/v1/chat/completions", headers={"X-Forwarded-Proto": "https"}, json={}).json()
        assert claimed["headers"]["x-forwarded-proto"] == "http"
        proxied = httpx.post(f"{base}/v1/chat/completions", json={}, headers={
            "X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}).json()
        assert (proxied["headers"]["x-forwarded-for"], proxied["headers"]["x-forwarded-proto"]) == ("203.0.113.9", "https")
        assert httpx.get(f"{base}/metrics?worker=1").json()["worker"] == 1
        bad = httpx.get(f"{base}/metrics?worker=7")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "worker"
    with front_over(tmp_path / "small", max_body=1024) as (base, _):
        too_big = httpx.post(f"{base}/v1/chat/completions", content=b"{" + b" " * 4096 + b"}",
                             headers={"content-type": "application/json"})
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
        anthropic = httpx.post(f"{base}/v1/messages", content=b"{" + b" " * 4096 + b"}")
        assert anthropic.status_code == 413 and anthropic.json()["type"] == "error"  # Anthropic's shape


def test_a_worker_that_is_gone_is_a_502_in_json_not_a_crash(tmp_path):
    import httpx

    with front_over(tmp_path) as (base, servers):
        sid = next(f"s{n}" for n in range(100) if owner(f"s{n}", 2) == 1)
        assert httpx.post(f"{base}/v1/chat/completions", headers={"X-Session-Id": sid}, json={}).status_code == 200
        servers[1].stop()  # worker 1 goes away (it died, or restarts)
        wait_for(lambda: not servers[1].started or servers[1].should_exit, what="worker 1 to stop")
        time.sleep(0.3)
        reply = httpx.post(f"{base}/v1/chat/completions", headers={"X-Session-Id": sid}, json={}, timeout=30)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "worker_unavailable", reply.text
        other = next(f"s{n}" for n in range(100) if owner(f"s{n}", 2) == 0)
        assert httpx.post(f"{base}/v1/chat/completions", headers={"X-Session-Id": other}, json={}).status_code == 200


def test_the_fronts_metrics_are_every_workers_labelled_and_the_pools_levels_once(tmp_path):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    with front_over(tmp_path) as (base, _):
        reply = httpx.get(f"{base}/metrics")
        assert reply.status_code == 200
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(reply.text) for s in family.samples}
        route = (("route", "/v1/chat/completions"), ("status", "200"))
        assert samples[("clawr1_requests_total", (*route, ("worker", "0")))] == 1
        assert samples[("clawr1_requests_total", (*route, ("worker", "1")))] == 2
        assert samples[("clawr1_pool_pending_writes", (("worker", "1"),))] == 10
        assert [v for (name, _), v in samples.items() if name == "clawr1_pool_ready_samples"] == [7]  # once


def test_the_front_is_a_thin_process():
    """No model stack in the front: it starts in well under a second and stays small."""
    import subprocess
    import sys

    probe = "import sys, clawr1.entrypoints.front; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_after_a_restart_each_worker_relearns_only_the_sessions_it_serves(engine, tmp_path, generations):
    from tests.unit.test_trainer import step_of

    pool = SQLitePool(tmp_path, config(tmp_path).pool)
    try:
        for i in range(8):
            pool.append_step(step_of(i, *generations[i]))  # sessions s0..s7, open, just active
        mine = {worker: {f"s{i}" for i in range(8) if owner(f"s{i}", 2) == worker} for worker in (0, 1)}
        assert mine[0] and mine[1]  # both workers own some
        for worker in (0, 1):
            gw = Gateway(engine, pool, config(tmp_path), worker=worker)
            assert gw.restore_sessions() == len(mine[worker])
            assert {session for _, session in gw.sessions.matcher._last} == mine[worker]
    finally:
        pool.close()
