"""The fuzz tier: schemathesis generates requests from the gateway's own `/openapi.json` (valid
ones, and invalid ones in every field) against a live gateway with a scripted engine, over every
route. Pass means: no answer >= 500 except 502/503/504 with an error body, every error body in its
API's shape, nothing left in flight, the server healthy after, and the pool holding exactly the
steps of the requests that were served. The hand-written hostile cases are in
`tests/unit/test_gateway_hostile.py`."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.gateway_helpers import live_gateway, wait_for
from tests.scripted_engine import ScriptedEngine, ScriptedStream
from tests.unit.test_gateway_hostile import ADMIN, anthropic_shaped, inflight, openai_shaped

EXAMPLES = 15  # per operation and generation mode: ~1,100 requests, ~70 s on 2 cores (40 made ~3,000, 190 s)
# Generation routes, with /v1 and without (`/{session}/{prompt}/chat/completions`, Claw-R1's base URL).
GENERATING = ("/chat/completions", "/completions", "/v1/messages", "/responses")


def content_type(response: Any) -> str:
    value = response.headers.get("content-type") or ""
    return value[0] if isinstance(value, list) else value  # schemathesis keeps every value of a header


def steps_served(path: str, response: Any) -> int:
    """Steps a 200 answer of a generation route stored: one per choice (streams: one)."""
    if response.status_code != 200 or not path.endswith(GENERATING):
        return 0
    if content_type(response).startswith("text/event-stream"):
        return 1
    body = response.json()
    return len(body["choices"]) if "choices" in body else 1


def check(path: str, response: Any) -> None:
    status = response.status_code
    assert status < 500 or status in (502, 503, 504), f"{path}: {status} {response.text[:500]}"
    if status < 400 or path.startswith("/dashboard"):  # the dashboard answers in HTML (sign-in page)
        return
    body = response.json()
    shaped = anthropic_shaped if path.endswith("/v1/messages") else openai_shaped
    assert shaped(body), f"{path}: {status} {response.text[:500]}"


def test_schemathesis_over_every_route(engine, tmp_path):
    scripted = ScriptedEngine(engine, "Hello there, friend.")
    with live_gateway(scripted, tmp_path, f'gateway.admin_key="{ADMIN}"', "gateway.max_body_bytes=65536") as (
            base, pool), httpx.Client(base_url=base, timeout=30) as client:
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {ADMIN}"
        served = {"steps": 0, "calls": 0}
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 20  # every route is in the schema, generation routes with their bodies
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def fuzz(case: Any) -> None:
                    response = case.call(base_url=base, session=session, timeout=30)
                    check(case.formatted_path, response)
                    served["steps"] += steps_served(case.formatted_path, response)
                    served["calls"] += 1

                try:
                    fuzz()
                except Unsatisfiable:
                    assert mode is GenerationMode.NEGATIVE  # nothing to break in a route without inputs
        assert served["calls"] > 600
        assert wait_for(lambda: inflight(client) == 0, what="inflight back to 0")
        assert client.get("/healthz").status_code == 200
        wait_for(lambda: pool.stats()["steps"] >= served["steps"], what="every served step committed")
        assert pool.stats()["steps"] == served["steps"]
        print(json.dumps(served))


# ---- hostile tenants (issue 41), each case followed by a restart --------------------------------

ACME, GLOBEX = "sk-acme-0001", "sk-globex-0001"
TENANTS = f'tenants.keys={{acme = ["{ACME}"], globex = ["{GLOBEX}"]}}'


def _chat(base: str, key: str, messages: list[dict], headers: dict | None = None, **extra: Any) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": "m", "max_tokens": 3, "messages": messages, **extra})


def _unknown_fields_and_oversized_extras(base: str, pool: Any) -> None:
    junk = "x" * 1_000_000
    kept = _chat(base, ACME, [{"role": "user", "content": [{"type": "text", "text": "hi", "pad": junk}], "x": junk}],
                 tools=[{"type": "function", "function": {"name": "f"}, "pad": junk}], n=8, max_tokens=1)
    assert kept.status_code == 200, kept.text
    refused = _chat(base, ACME, [{"role": "user", "content": "word " * 30_000}], n=8)
    assert refused.status_code in (400, 413) and openai_shaped(refused.json())


def _session_ids_of_steps(base: str, pool: Any) -> None:
    step_id = _chat(base, ACME, [{"role": "user", "content": "a step"}]).json()["id"] + "-0"
    for key in (GLOBEX, ACME):
        made = httpx.post(f"{base}/sessions", json={"session_id": step_id}, headers={"Authorization": f"Bearer {key}"})
        assert made.status_code == 200, made.text
        assert _chat(base, key, [{"role": "user", "content": "more"}], {"X-Session-Id": step_id}).status_code == 200
    closed = httpx.post(f"{base}/v1/sessions/{step_id}/close", json={}, headers={"Authorization": f"Bearer {GLOBEX}"})
    assert closed.status_code == 200 and closed.json()["turns"] == 1


def _session_ids_of_other_tenants(base: str, pool: Any) -> None:
    opening = [{"role": "user", "content": "acme's own conversation"}]
    reply = _chat(base, ACME, opening).json()
    wait_for(lambda: pool.stats(tenant="acme")["steps"] and pool.pending_writes() == 0, what="acme's step")
    theirs = max(pool.sessions(tenant="acme"), key=lambda s: s["updated_at"])["session_id"]
    assert _chat(base, GLOBEX, [{"role": "user", "content": "mine now"}], {"X-Session-Id": theirs}).status_code == 200
    closed = httpx.post(f"{base}/v1/sessions/{theirs}/close", json={"outcome_reward": -1},
                        headers={"Authorization": f"Bearer {GLOBEX}"})
    assert closed.status_code == 200 and closed.json()["turns"] == 1  # globex's namesake, not acme's session
    assert pool.show(theirs, "acme", "session")["status"] == "open"
    more = _chat(base, ACME, opening + [reply["choices"][0]["message"], {"role": "user", "content": "and on"}])
    assert more.status_code == 200
    wait_for(lambda: len(pool.show(theirs, "acme", "session")["steps"]) == 2, what="acme's session continued")


def _guessed_ids(base: str, pool: Any) -> None:
    guesses = [f"s-{n:024x}" for n in range(3)] + ["chatcmpl-000000000000000000000000-0"]
    for guess in guesses:
        assert _chat(base, GLOBEX, [{"role": "user", "content": "guess"}], {"X-Session-Id": guess}).status_code == 200
        assert httpx.post(f"{base}/v1/sessions/{guess}x/close", json={},
                          headers={"Authorization": f"Bearer {GLOBEX}"}).status_code == 404
    assert _chat(base, GLOBEX, [{"role": "user", "content": "hi"}], {"Authorization": "Bearer sk-clawr1-s-guess"}
                 ).status_code == 401


def _streams_never_read(base: str, pool: Any) -> None:
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "stream"}]}).encode()
    readers = []
    for _ in range(4):
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a client that reads nothing, and takes little
        raw.connect(("127.0.0.1", port))
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + ACME.encode()
                    + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                    + b"\r\n\r\n" + body)
        readers.append(raw)
    try:
        wait_for(lambda: pool.stats(tenant="acme")["steps"] >= 0, what="the streams to start")
        assert _chat(base, GLOBEX, [{"role": "user", "content": "still served"}]).status_code == 200
        with httpx.Client(base_url=base) as client:
            wait_for(lambda: inflight(client) == 0, timeout=30, what="the unread streams' slots back")
    finally:
        for raw in readers:
            raw.close()


class Endless(ScriptedEngine):
    """Replies 2,000 tokens a millisecond apart, each with 8 KB of text (16 MB of events: more than a
    socket's buffers hold), made without decoding every prefix as `ScriptedEngine` does."""

    def generate(self, prompt_ids, sampling, adapter=None, affinity=None):
        [token] = self.tokenizer.encode(" word", add_special_tokens=False)
        return ScriptedStream(prompt_ids, [token] * 2000, [" word" * 1600] * 2000, 0.001)


def test_hostile_tenants_and_a_restart_after_each(engine, tmp_path):
    """Each case a tenant could send, then a restart: the gateway starts cleanly, stores what it
    stored before the restart, keeps no unrendered field, and no case of one tenant's changed what
    another stored."""
    short, long = ScriptedEngine(engine, "Hello there, friend."), Endless(engine, "")
    overrides = [TENANTS, f'gateway.admin_key="{ADMIN}"', "gateway.max_request_store_bytes=400000",
                 "gateway.send_timeout_s=0.5"]
    for case in (_unknown_fields_and_oversized_extras, _session_ids_of_steps, _session_ids_of_other_tenants,
                 _guessed_ids, _streams_never_read):
        scripted = long if case is _streams_never_read else short  # long: writes the client never takes
        with live_gateway(scripted, tmp_path, *overrides) as (base, pool):
            globex_before = pool.stats(tenant="globex")["steps"]
            case(base, pool)
            wait_for(lambda: pool.pending_writes() == 0, what="every write committed")
            stored = pool.stats()["steps"]
            if case is _unknown_fields_and_oversized_extras:  # acme's alone
                assert pool.stats(tenant="globex")["steps"] == globex_before, case.__name__
        with live_gateway(scripted, tmp_path, *overrides) as (base, pool):  # the restart
            assert httpx.get(f"{base}/healthz").status_code == 200, case.__name__
            assert pool.stats()["steps"] == stored, case.__name__
            for tenant in ("acme", "globex"):
                for session in pool.sessions(limit=10_000, tenant=tenant):
                    steps = pool.show(session["session_id"], tenant, "session")["steps"]
                    for step in pool.get_steps([s["step_id"] for s in steps]):
                        assert step.tenant == tenant and "x" * 1000 not in json.dumps([step.messages, step.tools])
            assert _chat(base, ACME, [{"role": "user", "content": "after the restart"}]).status_code == 200
