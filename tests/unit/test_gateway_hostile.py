"""No input can break or lock the gateway: hostile bodies on every route get a 4xx in the route's
own error shape, the keep-alive connection survives them, no admission slot leaks on any path
(success, disconnect, timeout, validation, engine error, recording error, a bug), and the pool
holds exactly the steps of the requests that were served."""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clawr1.core.types import EngineFailure, EngineOverloadedError
from tests.gateway_helpers import live_gateway, steps_of, wait_for
from tests.scripted_engine import ScriptedEngine, ScriptedStream

ADMIN = "admin-key-0123456789abcdef"
CHAT = "/v1/chat/completions"
VALID = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
POSTS = [CHAT, "/s-1/p-1" + CHAT, "/v1/completions", "/v1/messages", "/v1/responses", "/v1/feedback",
         "/v1/sessions/s-1/close", "/admin/sessions"]


def nested(levels: int) -> bytes:
    return b'{"messages": ' + b'[{"messages": ' * levels + b"1" + b"}]" * levels + b"}"


def chat_body(**fields: Any) -> bytes:
    return json.dumps({**VALID, **fields}).encode()


HOSTILE: list[tuple[str, str, bytes]] = [
    # (name, route, raw body): each used to be a 500, a dropped connection, or a leaked slot
    ("tool_calls items are strings", CHAT, chat_body(messages=[
        {"role": "assistant", "content": None, "tool_calls": ["x"]}, {"role": "user", "content": "hi"}])),
    ("tool_calls is a string", CHAT, chat_body(messages=[{"role": "assistant", "tool_calls": "x"},
                                                          {"role": "user", "content": "hi"}])),
    ("tool_calls is a nested dict", CHAT, chat_body(messages=[{"role": "assistant", "tool_calls": {"a": {"b": 1}}},
                                                              {"role": "user", "content": "hi"}])),
    ("function.arguments is a number", CHAT, chat_body(messages=[
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": 5}}]},
        {"role": "user", "content": "hi"}])),
    ("role is an object", CHAT, chat_body(messages=[{"role": {"x": 1}, "content": "hi"}])),
    ("content part is an image", CHAT, chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}])),
    ("messages is a huge array of numbers", CHAT, chat_body(messages=list(range(200_000)))),
    ("stop has 1000 entries", CHAT, chat_body(stop=["x"] * 1000)),
    ("temperature is NaN", CHAT, chat_body().replace(b'"max_tokens": 3', b'"max_tokens": 3, "temperature": NaN')),
    ("a tool schema holds Infinity", CHAT, chat_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]).replace(b'"object"', b"Infinity")),
    ("seed is 2^70", CHAT, chat_body(seed=2**70)),
    # Beyond a double's range: Python reads it as inf, which no reply or stored step can carry.
    ("a tool schema holds 1e400", CHAT, chat_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]).replace(b'"object"', b"1e400")),
    ("a responses tool holds -1e400", "/v1/responses", (b'{"model": "m", "input": "hi", "tools": [{"type": '
                                                        b'"function", "name": "f", "parameters": {"type": "object", '
                                                        b'"x": -1e400}}]}')),
    ("tool_choice is junk", CHAT, chat_body(tool_choice={"x": [1, 2]})),
    ("lone surrogate", CHAT, chat_body().replace(b'"hi"', b'"hi \\ud800 there"')),
    ("invalid UTF-8", CHAT, chat_body().replace(b'"hi"', b'"hi \xff\xfe"')),
    ("a raw UTF-8 surrogate", CHAT, chat_body().replace(b'"hi"', b'"hi \xed\xa0\x80"')),
    ("a UTF-16 body", CHAT, json.dumps({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]},
                                       ensure_ascii=False).encode("utf-16", "surrogatepass")),
    # Past the depth scan's bracket count, then a string that never ends: the scan once retried at
    # every later quote (40 KB took 5 s of the event loop); now one pass.
    ("an unterminated string after many brackets", CHAT, b"[]" * 65 + b'"' + b'\\"' * 100_000),
    ("top level is an array", CHAT, b"[1, 2, 3]"),
    ("broken JSON", CHAT, b'{"model": "m", "messages": [{'),
    ("token id out of range", "/v1/completions", json.dumps({"model": "m", "prompt": [10**9]}).encode()),
    ("negative token id", "/v1/completions", json.dumps({"model": "m", "prompt": [-1]}).encode()),
    ("anthropic block is a string", "/v1/messages", json.dumps({"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": ["x"]}]}).encode()),
    ("anthropic role is a list", "/v1/messages", json.dumps({"model": "m", "max_tokens": 3, "messages": [
        {"role": ["user"], "content": "x"}]}).encode()),
    ("responses item is a number", "/v1/responses", json.dumps({"model": "m", "input": [1, 2]}).encode()),
    ("responses tool_choice is junk", "/v1/responses", json.dumps({"model": "m", "input": "x",
                                                                  "tool_choice": [1]}).encode()),
    ("feedback turn index beyond int64", "/v1/feedback", json.dumps({"session_id": "s", "turn_index": 2**70,
                                                                     "reward": 1}).encode()),
] + [(f"1000-level nesting on {route}", route, nested(1000)) for route in POSTS]


def anthropic_shaped(body: dict[str, Any]) -> bool:
    return body.get("type") == "error" and set(body["error"]) == {"type", "message"} and bool(body["error"]["message"])


def openai_shaped(body: dict[str, Any]) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"} and bool(
        body["error"]["message"])


def inflight(client: httpx.Client) -> float:
    page = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    for family in text_string_to_metric_families(page):
        if family.name == "clawr1_gateway_inflight":
            return family.samples[0].value
    raise AssertionError("no clawr1_gateway_inflight on /metrics")


@pytest.fixture
def scripted(engine):
    return ScriptedEngine(engine, "Hello there, friend.")


def test_hostile_bodies_get_4xx_in_the_routes_shape_and_the_connection_survives(scripted, tmp_path):
    served = 0
    with live_gateway(scripted, tmp_path, f'gateway.admin_key="{ADMIN}"') as (base, pool), \
            httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}) as client:
        for name, route, raw in HOSTILE + [("10 MB string", CHAT, chat_body(user="x" * 10_000_000))]:
            response = client.post(route, content=raw, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
            shaped = anthropic_shaped if route.endswith("/v1/messages") else openai_shaped
            assert shaped(response.json()), (name, response.text[:300])
            # The same keep-alive connection serves the next, valid, request.
            assert client.post(CHAT, json=VALID).status_code == 200, name
            served += 1
        assert wait_for(lambda: inflight(client) == 0, what="inflight back to 0")
        assert client.get("/healthz").status_code == 200
        assert len(steps_of(pool, served)) == served  # exactly the valid requests' steps
        assert pool.stats()["steps"] == served


def test_dot_segment_and_newline_session_ids_are_refused(scripted, tmp_path):
    """"." and ".." would be dot segments in the dashboard's session links (browsers resolve them
    away); a final newline got past the id check's `$`."""
    with live_gateway(scripted, tmp_path) as (base, pool):
        for sid in (".", ".."):
            refused = httpx.post(f"{base}{CHAT}", json=VALID, headers={"X-Session-Id": sid})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Session-Id"
        refused = httpx.post(f"{base}/abc%0A/p/v1/chat/completions", json=VALID)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "session_id"
        assert httpx.post(f"{base}{CHAT}", json=VALID, headers={"X-Session-Id": "..a"}).status_code == 200
        assert [s.session_id for s in steps_of(pool, 1)] == ["..a"]


def test_a_request_larger_than_the_gateway_ever_admits_is_a_400_not_a_429(scripted, tmp_path):
    """prompts x n beyond `gateway.max_pending` can never run: a 429 ("retry shortly") would have
    SDKs retry it forever on an idle gateway."""
    with live_gateway(scripted, tmp_path, "gateway.max_pending=4") as (base, pool), \
            httpx.Client(base_url=base, timeout=30) as client:
        too_many = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
        assert too_many.status_code == 400, too_many.text
        assert too_many.json()["error"]["code"] == "invalid_value" and "max_pending" in too_many.json()["error"]["message"]
        fits = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert fits.status_code == 200, fits.text
        assert len(steps_of(pool, 4)) == 4


def test_malformed_requests_cannot_lock_the_gateway(scripted, tmp_path):
    """The lock-out: every 500 used to leak its admission slot, and after `max_pending` of them
    every request got 429 forever."""
    bad = HOSTILE[0][2]
    with live_gateway(scripted, tmp_path, "gateway.max_pending=4", f'gateway.admin_key="{ADMIN}"') as (base, pool), \
            httpx.Client(base_url=base, timeout=30) as client:
        for _ in range(40):
            assert client.post(CHAT, content=bad, headers={"content-type": "application/json"}).status_code == 400
        assert client.post(CHAT, json=VALID).status_code == 200
        assert inflight(client) == 0


class FailingEngine(ScriptedEngine):
    """Fails where it is told: at submission (`at="submit"`), or after two tokens (`at="mid"`)."""

    def __init__(self, engine: Any, at: str, error: Exception):
        super().__init__(engine, "one two three four five six", delay=0.01)
        self.at, self.error = at, error

    def generate(self, *args: Any, **kwargs: Any) -> ScriptedStream:
        if self.at == "submit":
            raise self.error
        stream = super().generate(*args, **kwargs)
        stream.__class__ = FailingStream
        stream.error = self.error  # type: ignore[attr-defined]
        return stream


class FailingStream(ScriptedStream):
    error: Exception

    async def __anext__(self) -> Any:
        if self.sampled == 2:
            raise self.error
        return await super().__anext__()


class BuggyParse(ScriptedEngine):
    def parse(self, text: str, tools: Any = None) -> Any:
        raise RuntimeError("a bug in the engine's parser")


class FailingPool:
    """A real pool whose step writes fail: refused at once, or acknowledged with an error."""

    def __init__(self, pool: Any, how: str):
        self.pool, self.how = pool, how

    def submit_step(self, step: Any) -> Future:
        if self.how == "refused":
            raise OSError(28, "No space left on device")
        future: Future = Future()
        future.set_exception(OSError(28, "No space left on device"))
        return future

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


@pytest.mark.parametrize("stream", [False, True])
def test_every_path_gives_its_admission_back(engine, tmp_path, stream):
    body = {**VALID, "stream": stream}
    slow = ScriptedEngine(engine, "one two three four five six seven eight", delay=0.2)

    def check(eng: Any, *overrides: str, expect: int | None, hang_up: bool = False, pool_fault: str | None = None,
              error_event: bool = False) -> None:
        wrap = (lambda pool: FailingPool(pool, pool_fault)) if pool_fault else None
        with live_gateway(eng, tmp_path / f"{len(list(tmp_path.iterdir()))}", f'gateway.admin_key="{ADMIN}"',
                          *overrides, wrap_pool=wrap) as (base, pool), httpx.Client(base_url=base, timeout=30) as client:
            if hang_up:  # read a little, then close the connection
                if stream:
                    with client.stream("POST", CHAT, json=body) as response:
                        assert [line for _, line in zip(range(3), response.iter_lines())]
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        client.post(CHAT, json=body, timeout=0.3)
                [step] = steps_of(pool, 1)
                assert step.finish_reason == "aborted"
            else:
                response = client.post(CHAT, json=body)
                assert response.status_code == expect, response.text
                if error_event:  # a stream that failed mid-way ends with an error object, not a cut
                    last = [line for line in response.text.splitlines() if line.startswith("data: ")][-1]
                    assert openai_shaped(json.loads(last[6:])), response.text
                    assert "[DONE]" not in response.text
            assert wait_for(lambda: inflight(client) == 0, what="inflight back to 0")
            assert client.get("/healthz").status_code == 200

    check(ScriptedEngine(engine, "Hi."), expect=200)  # success
    check(slow, expect=None, hang_up=True)  # client disconnect
    check(slow, "gateway.request_timeout_s=0.3", expect=200 if stream else 504, error_event=stream)  # timeout
    check(FailingEngine(engine, "submit", EngineOverloadedError("the engine is full")), expect=429)  # engine refuses
    check(FailingEngine(engine, "mid", EngineFailure("the engine died")), expect=200 if stream else 502,
          error_event=stream)  # engine fails mid-way
    check(BuggyParse(engine, "Hi."), expect=200 if stream else 500, error_event=stream)  # a bug
    durable = "gateway.durable_reply=true"  # the reply waits for its commit, so a failed one is an error
    check(ScriptedEngine(engine, "Hi."), durable, expect=200 if stream else 503, pool_fault="refused",
          error_event=stream)  # recording refused
    check(ScriptedEngine(engine, "Hi."), durable, expect=200 if stream else 503, pool_fault="failed",
          error_event=stream)  # commit failed
    check(ScriptedEngine(engine, "Hi."), "gateway.durable_reply=false", expect=200,
          pool_fault="failed")  # reply first: served, the loss logged


def test_a_bug_before_the_exchange_is_a_500_in_the_routes_shape_and_counted(scripted, tmp_path, monkeypatch):
    """A fault in a wire's own parse (`Wire.prepare`) on the hot routes: answered 500 in the route's
    error shape (Anthropic's on /v1/messages), counted as a 500 on /metrics, nothing admitted."""
    from clawr1.gateway.wire import anthropic, chat

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in a wire's parse")

    monkeypatch.setattr(chat.CHAT, "prepare", broken)
    monkeypatch.setattr(anthropic.MESSAGES, "prepare", broken)
    with live_gateway(scripted, tmp_path, f'gateway.admin_key="{ADMIN}"') as (base, pool), \
            httpx.Client(base_url=base, timeout=30) as client:
        response = client.post(CHAT, json=VALID)
        assert response.status_code == 500 and openai_shaped(response.json()), response.text
        assert response.json()["error"]["code"] == "internal_error" and "RuntimeError" in response.text
        response = client.post("/v1/messages", json={"model": "m", "max_tokens": 3,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 500 and anthropic_shaped(response.json()), response.text
        completion = {"model": "m", "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=completion).status_code == 200
        with client.stream("POST", "/v1/completions", json={**completion, "stream": True}) as streamed:
            assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()
        page = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
        counted = {(s.labels["route"], s.labels["status"]): s.value for family in text_string_to_metric_families(page)
                   for s in family.samples if s.name == "clawr1_requests_total"}
        assert counted[(CHAT, "500")] == 1 and counted[("/v1/messages", "500")] == 1
        assert counted[("/v1/completions", "200")] == 2  # plain and streamed, each with the status it sent
        assert inflight(client) == 0 and len(steps_of(pool, 2)) == 2  # only the completions were served


@pytest.mark.parametrize("stream", [False, True])
def test_a_fault_while_recording_or_settling_frees_the_slot_and_stays_in_the_gateway(scripted, tmp_path, monkeypatch,
                                                                                  caplog, stream):
    """A bug while the steps are handed to the pool (a half-done `_submit`) still gives the
    admission back; a failure in the settle after the reply (closing an `X-Session-Done` session
    on a pool that cannot) is logged by the gateway, not thrown at the ASGI server."""
    from clawr1.gateway import pipeline

    class ClosingFails:
        def __init__(self, pool: Any):
            self.pool = pool

        def close_session(self, *args: Any, **kwargs: Any) -> Any:
            raise OSError(5, "Input/output error")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.pool, name)

    body = {**VALID, "stream": stream}
    with live_gateway(scripted, tmp_path, f'gateway.admin_key="{ADMIN}"', wrap_pool=ClosingFails) as (base, _pool), \
            httpx.Client(base_url=base, timeout=30) as client:
        response = client.post(CHAT, json=body, headers={"X-Session-Done": "true"})
        assert response.status_code == 200, response.text
        assert wait_for(lambda: "unhandled error in the gateway" in caplog.text, what="the settle's error logged")
        assert "Exception in ASGI application" not in caplog.text
        assert wait_for(lambda: inflight(client) == 0, what="inflight back to 0")

        def broken_step(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug while building the step")

        monkeypatch.setattr(pipeline, "Step", broken_step)
        response = client.post(CHAT, json=body)
        assert response.status_code == (200 if stream else 500), response.text
        if stream:  # the stream had started: it ends with an error event
            last = [line for line in response.text.splitlines() if line.startswith("data: ")][-1]
            assert openai_shaped(json.loads(last[6:])), response.text
        assert wait_for(lambda: inflight(client) == 0, what="inflight back to 0 after a half-done _submit")

