"""The gateway over real HTTP on 127.0.0.1: the official openai client, sessions, errors, recording."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from clawr1.core.config import load_config
from clawr1.datapool import SQLitePool
from clawr1.gateway.app import create_app
from tests.conftest import run
from tests.gateway_helpers import live_gateway, steps_of


@pytest.fixture
def server(engine, tmp_path):
    """A live gateway on the tiny model; yields (base_url, pool)."""
    with live_gateway(engine, tmp_path, "gateway.max_body_bytes=65536") as served:
        yield served


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_openai_client_reply_is_recorded_token_faithfully(server, engine):
    base, pool = server
    reply = client(base).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say something."}], max_tokens=12, temperature=0.8,
        seed=3, logprobs=True)
    assert reply.system_fingerprint == "clawr1-v0"
    text = reply.choices[0].message.content
    [step] = steps_of(pool, 1)
    assert engine.tokenizer.decode(step.token_ids, skip_special_tokens=True) == text
    assert step.logprobs == [c.logprob for c in reply.choices[0].logprobs.content]
    assert step.policy_version == 0 and step.turn_type == "main" and step.messages[0]["content"] == "Say something."
    assert reply.usage.completion_tokens == len(step.token_ids)


def test_streaming_deltas_are_the_recorded_text(server, engine):
    base, pool = server
    chunks = list(client(base).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Stream please."}], max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    [step] = steps_of(pool, 1)
    assert engine.tokenizer.decode(step.token_ids, skip_special_tokens=True) == text
    assert chunks[-1].usage.completion_tokens == len(step.token_ids)


def test_a_spliced_content_chunk_is_the_chunk_built_whole():
    """`Chunks.content` splices the delta's JSON into an envelope rendered once; it must be the very
    chunk `json.dumps` of the whole body gives, whatever the text and the client's model name."""
    from clawr1.gateway.streaming import MARK as _MARK
    from clawr1.gateway.wire.chat import Chunks

    texts = ["", " hello", 'a "quoted" \\ back\nslash', "é ✓ 🙂", "</script>", _MARK, "\x00\u2028"]
    for model in ["m", 'model "x"', f"a{_MARK}b", _MARK]:
        chunks = Chunks("chatcmpl-1", model, 3, 1_700_000_000)
        for text in texts:
            assert chunks.content(text) == chunks.event({"content": text}), (model, text)
        assert json.loads(chunks.content("hi")[6:])["created"] == chunks.body({})["created"]  # one per stream


def test_async_client_concurrent_requests(server):
    base, pool = server

    async def go():
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*[c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Question {i}"}], max_tokens=6) for i in range(6)])

    replies = run(go())
    assert len(replies) == 6 and len(steps_of(pool, 6)) == 6
    assert pool.stats()["sessions"] == 6  # six unrelated conversations


def test_session_identification(server):
    base, pool = server
    c = client(base)
    ask = {"model": "m", "max_tokens": 4, "temperature": 0}
    # 1. URL path ids
    httpx.post(f"{base}/sess-A/prompt-1/v1/chat/completions",
               json={"messages": [{"role": "user", "content": "hi"}], **ask}).raise_for_status()
    # 2. headers
    c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **ask,
                              extra_headers={"X-Session-Id": "sess-B", "X-Turn-Type": "side"})
    # 4. automatic: two interleaved stock-client conversations, each replaying its history
    histories = {"x": [{"role": "user", "content": "I am conversation X"}],
                 "y": [{"role": "user", "content": "I am conversation Y"}]}
    for turn in range(3):
        for name, history in histories.items():
            reply = c.chat.completions.create(messages=history, **ask)
            history += [{"role": "assistant", "content": reply.choices[0].message.content},
                        {"role": "user", "content": f"{name} turn {turn + 1}"}]
    steps = steps_of(pool, 8)
    by_session = {}
    for step in steps:
        by_session.setdefault(step.session_id, []).append(step)
    assert by_session["sess-A"][0].prompt_id == "prompt-1"
    assert by_session["sess-B"][0].turn_type == "side"
    auto = [s for sid, s in by_session.items() if sid not in ("sess-A", "sess-B")]
    assert sorted(len(s) for s in auto) == [3, 3]
    for session in auto:
        first = {s.messages[0]["content"] for s in session}
        assert len(first) == 1  # never mixed
        assert sorted(s.turn_index for s in session) == [0, 1, 2]
        # Each turn answers its own prompt: a GRPO group of one, not the whole session.
        assert len({s.prompt_id for s in session}) == 3


def test_matcher_tolerates_a_dropped_trailing_message_and_rewritten_tool_ids(server):
    """OpenClaw appends an internal-context message that the next request drops."""
    base, pool = server
    c = client(base)
    ask = {"model": "m", "max_tokens": 4, "temperature": 0}
    internal = {"role": "user", "content": [{"type": "text", "text": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> ..."}]}
    history = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "first"}]
    reply = c.chat.completions.create(messages=history + [internal], **ask)
    history += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "second"}]
    c.chat.completions.create(messages=history + [internal], **ask)
    steps = steps_of(pool, 2)
    assert len({s.session_id for s in steps}) == 1


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "m", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "m", "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "messages[0].role"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 5}).encode(), 400, "temperature"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "tools": [{"type": "function", "function": {"name": "bad name!"}}]}).encode(), 400, "tools[0].function.name"),
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 70000}]}).encode(), 413, None),
])
def test_bad_input_gets_openai_errors_and_stores_nothing(server, body, status, param):
    base, pool = server
    response = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    time.sleep(0.1)
    assert pool.stats()["steps"] == 0


def test_unknown_route_and_models(server):
    base, _ = server
    assert httpx.get(f"{base}/v1/nope").json()["error"]["code"] == "unknown_route"
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"
    assert httpx.get(f"{base}/healthz").json()["ok"] is True


def test_api_keys_are_required_when_configured(engine, tmp_path):
    from fastapi.testclient import TestClient

    config = load_config(None, [f'data_dir="{tmp_path}"', 'gateway.api_keys=["sk-good-key"]'])
    pool = SQLitePool(tmp_path, config.pool)
    try:
        with TestClient(create_app(engine, pool, config)) as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good-key"}):
                response = http.post("/v1/chat/completions", json=body, headers=headers)
                assert response.status_code == 401
                assert response.json()["error"]["code"] == "invalid_api_key"
            assert http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-good-key"}).status_code == 200
        assert pool.stats()["steps"] <= 1
    finally:
        pool.close()


def test_refuses_to_expose_without_keys(tmp_path):
    from clawr1.gateway.server import check_exposure

    with pytest.raises(ValueError, match="without API keys"):
        check_exposure(load_config(None, ['gateway.host="0.0.0.0"']))
    assert "loopback" in check_exposure(load_config(None, []))
    assert "1 API key" in check_exposure(load_config(None, ['gateway.host="0.0.0.0"', 'gateway.api_keys=["agent-key-1"]']))


def test_streamed_logprobs_cover_every_sampled_token(server):
    base, pool = server
    chunks = list(client(base).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Stream with logprobs."}], max_tokens=12, temperature=0.7,
        seed=2, logprobs=True, stream=True))
    streamed = [entry.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for entry in c.choices[0].logprobs.content]
    [step] = steps_of(pool, 1)
    assert streamed == step.logprobs
    assert {c.system_fingerprint for c in chunks} == {"clawr1-v0"}


async def _stream_writes(app, body: dict, times: list[float] | None = None) -> list[bytes]:
    """POST a streamed chat request straight to the ASGI app; the body of each send, in order
    (and when each was sent, into `times`)."""
    lifespan: asyncio.Queue = asyncio.Queue()
    await lifespan.put({"type": "lifespan.startup"})
    started = asyncio.Event()

    async def lifespan_send(message):
        started.set()

    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, lifespan.get,
                                   lifespan_send))
    await started.wait()
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
    requests = [{"type": "http.request", "body": raw, "more_body": False}]
    writes: list[bytes] = []
    never = asyncio.Event()

    async def receive():
        if requests:
            return requests.pop()
        await never.wait()  # the client stays connected

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            writes.append(message["body"])
            if times is not None:
                times.append(time.monotonic())

    await app(scope, receive, send)
    await lifespan.put({"type": "lifespan.shutdown"})
    await task
    return writes


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_a_burst_of_ready_tokens_is_one_write_and_a_token_waited_for_is_sent_at_once(engine, tmp_path, delay):
    """A streamed reply holds an event while the engine's next one is already there and sends the
    held ones together: tokens sampled at once (delay 0: a burst) cost one write, not one each;
    tokens the gateway had to wait for (delay 0.05 s) each go out as soon as they come. The
    events the client reads are the same either way."""
    from tests.scripted_engine import ScriptedEngine

    reply = "one two three four five six seven eight"
    scripted = ScriptedEngine(engine, reply, delay=delay)
    tokens = len(scripted.generate([1], None).token_ids)  # what the stream will yield, end of text included
    config = load_config(None, [f'data_dir="{tmp_path}"'])
    pool = SQLitePool(tmp_path, config.pool)
    try:
        writes = run(_stream_writes(create_app(scripted, pool, config),
                                    {"model": "m", "messages": [{"role": "user", "content": "Count."}], "stream": True}))
    finally:
        pool.close()
    events = [e for e in b"".join(writes).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == reply
    if delay == 0:
        assert len(writes) <= 3  # the role chunk, then everything that was ready together
    else:
        assert len(writes) >= tokens  # each awaited token in a write of its own


def test_the_last_tokens_of_a_stream_do_not_wait_for_the_commit(engine, tmp_path):
    """With durable replies the step is committed before the final events, but the text sampled
    before that is sent first: the last token (ready together with the end of the generation, so
    held) goes out before a slow commit ends, not with the finish event after it."""
    import threading
    from concurrent.futures import Future

    from tests.scripted_engine import ScriptedEngine, ScriptedStream

    class CutAtLength(ScriptedEngine):
        """No end-of-text token: the last token and the end of the generation come together."""

        def generate(self, prompt_ids, sampling, adapter=None, affinity=None):
            ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
            texts = [self.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
            return ScriptedStream(prompt_ids, ids, [texts[i + 1][len(texts[i]):] for i in range(len(ids))], self.delay)

    committed: list[float] = []

    class SlowCommit:
        def __init__(self, pool):
            self.pool = pool

        def submit_step(self, step):
            slow: Future = Future()

            def later(done):
                def finish():
                    committed.append(time.monotonic())
                    slow.set_result(done.result())
                threading.Timer(0.15, finish).start()
            self.pool.submit_step(step).add_done_callback(later)
            return slow

        def __getattr__(self, name):
            return getattr(self.pool, name)

    reply = "one two three"
    config = load_config(None, [f'data_dir="{tmp_path}"', "gateway.durable_reply=true"])
    pool = SQLitePool(tmp_path, config.pool)
    times: list[float] = []
    try:
        writes = run(_stream_writes(create_app(CutAtLength(engine, reply, delay=0.02), SlowCommit(pool), config),
                                    {"model": "m", "messages": [{"role": "user", "content": "Count."}], "stream": True},
                                    times))
    finally:
        pool.close()
    texts = [w.decode() for w in writes]
    last = max(i for i, t in enumerate(texts) if '"content":' in t and "three" in t)
    finish = min(i for i, t in enumerate(texts) if '"finish_reason":' in t and '"finish_reason":null' not in t)
    assert last < finish and times[last] < committed[0] <= times[finish], (texts, times, committed)


@pytest.mark.parametrize("reply", [
    'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\nDone soon.',
])
def test_a_streamed_tool_call_reply_says_what_the_plain_reply_says(engine, tmp_path, reply):
    """Whitespace before a call is held (the plain content strips it) and text after the calls is
    sent at the end (the plain content keeps it)."""
    from tests.scripted_engine import ScriptedEngine

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": tools}
    with live_gateway(ScriptedEngine(engine, reply), tmp_path) as (base, _):
        plain = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]
        lines = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=30).text.splitlines()
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines if line.startswith("data: {")]
    assert "".join(d.get("content") or "" for d in deltas) == plain["content"]
    assert [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])] == \
        [c["function"]["arguments"] for c in plain["tool_calls"]]
