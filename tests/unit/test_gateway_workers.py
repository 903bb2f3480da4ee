"""`gateway.workers`: the front's routing rule (every request of a session reaches the worker that
holds it, read from the request alone), the sessions a worker opens named for it, and a follower
serving what the leader serves, on its own engine or on a server they share."""

from __future__ import annotations

import asyncio
import collections
import contextlib

import pytest
from fastapi.routing import APIRoute

from clawr1.core.config import Config, EngineConfig
from clawr1.core.types import SamplingParams
from clawr1.datapool import SQLitePool
from clawr1.engine.local import LocalEngine
from clawr1.engine.sglang import SGLangEngine
from clawr1.entrypoints.server import in_thread, make_server
from clawr1.gateway.app import create_app
from clawr1.gateway.dispatch import owner, path_session, route
from clawr1.gateway.matcher import SUMMARISER_PROMPTS
from clawr1.gateway.service import Gateway
from clawr1.gateway.sessions import SessionResolver
from tests.conftest import run
from tests.sglang_fake import sglang_app
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


@pytest.fixture
def shared_server(tiny_model_dir):
    """A fake SGLang server (SGLang's API over the real local engine) two gateway processes share."""
    backend = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    app = sglang_app(backend)
    server = make_server(app)
    with in_thread(server, server.serve, name="fake-sglang", start_timeout_s=30) as background:
        yield f"http://127.0.0.1:{background.port}", app
    run(backend.close())


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
        shared_server, tiny_model_dir, tmp_path):
    """The leader loads, the follower only adopts (no second load); when the leader moves on, the
    version it retired stays on the server `retire_delay_s`, so the follower's request on it (one
    poll behind) still runs; then it is unloaded."""
    url, app = shared_server
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


@pytest.fixture
def own_engine(tiny_model_dir):
    engine = LocalEngine.load(tiny_model_dir, EngineConfig(threads=1, max_batch=8))
    yield engine
    run(engine.close())


def test_a_follower_with_its_own_engine_loads_what_the_leader_serves_and_drops_what_it_stopped(
        own_engine, tiny_model_dir, tmp_path):
    pool = SQLitePool(tmp_path, config(tmp_path).pool)
    try:
        gw = Gateway(own_engine, pool, config(tmp_path), worker=1)
        v1 = make_adapter(tiny_model_dir, tmp_path, 1, seed=0)
        run(gw._follow({"adapters": {"policy": [1, str(v1)]}, "weights": [0, ""]}))
        assert own_engine.adapters() == {"policy": 1}
        run(gw._follow({"adapters": {}, "weights": [0, ""]}))  # the leader went back to the base
        assert own_engine.adapters() == {}
    finally:
        pool.close()
