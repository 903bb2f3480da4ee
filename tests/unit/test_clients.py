"""Stock clients against a live gateway, each the real thing: the OpenAI Node SDK (npm), LangChain's
`ChatOpenAI`, and curl reading SSE. Every call must be served and recorded like any other."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.gateway_helpers import live_gateway, steps_of
from tests.npm_helpers import node_bin, npm_install
from tests.scripted_engine import ScriptedEngine

OPENAI_NODE = "openai@7.55.0"
KEY = "agent-key-1"
CALL = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def node_client(base: str, mode: str) -> dict:
    folder = npm_install("openai-node", OPENAI_NODE)
    script = folder / "openai_node.mjs"  # beside its node_modules, where `import "openai"` resolves
    shutil.copy(Path(__file__).parent.parent / "clients" / "openai_node.mjs", script)
    done = subprocess.run([str(node_bin() / "node"), str(script), base, KEY, mode], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_openai_node_sdk_chats_streams_and_gets_openai_errors(engine, tmp_path):
    with live_gateway(engine, tmp_path, f'gateway.api_keys=["{KEY}"]') as (base, pool):
        out = node_client(base, "chat")
        steps = steps_of(pool, 2)
    plain, stream = out["plain"], out["stream"]
    assert plain["fingerprint"] == "clawr1-v0" and plain["id"].startswith("chatcmpl-")
    assert stream["text"] == plain["content"] and stream["finish"] == plain["finish"]  # greedy: the same reply
    assert stream["usage"] == plain["usage"] and stream["chunks"] >= 3
    assert out["error"]["status"] == 400 and out["error"]["type"] == "invalid_request_error"
    assert sorted(s.text for s in steps) == [plain["content"]] * 2
    assert {s.step_id for s in steps} >= {f"{plain['id']}-0"}


def test_openai_node_sdk_tool_calls_plain_and_streamed(engine, tmp_path):
    with live_gateway(ScriptedEngine(engine, CALL), tmp_path, f'gateway.api_keys=["{KEY}"]') as (base, pool):
        out = node_client(base, "tools")
        steps = sorted(steps_of(pool, 2), key=lambda s: s.turn_index)
    assert out["call"] == {"finish": "tool_calls", "name": "get_weather", "args": {"city": "Paris"}}
    assert out["streamed_call"] == ["get_weather"]
    assert [s.turn_index for s in steps] == [0, 1] and steps[0].session_id == steps[1].session_id
    assert steps[1].messages[-1]["role"] == "tool" and steps[1].messages[-1]["content"] == "18 C"


def test_langchain_chat_openai_invokes_streams_and_binds_tools(engine, tmp_path):
    langchain_openai = pytest.importorskip("langchain_openai", reason="pip install langchain-openai (a test dependency)")
    with live_gateway(engine, tmp_path / "chat") as (base, pool):
        llm = langchain_openai.ChatOpenAI(base_url=f"{base}/v1", api_key="unused", model="m", max_tokens=8,
                                          temperature=0, max_retries=0)
        reply = llm.invoke("Hello from LangChain")
        streamed = "".join(chunk.content for chunk in llm.stream("Hello from LangChain"))
        steps = steps_of(pool, 2)
    assert reply.content and streamed == reply.content
    assert reply.response_metadata["system_fingerprint"] == "clawr1-v0"
    assert [s.text for s in steps] == [reply.content] * 2
    with live_gateway(ScriptedEngine(engine, CALL), tmp_path / "tools") as (base, pool):
        llm = langchain_openai.ChatOpenAI(base_url=f"{base}/v1", api_key="unused", model="m", max_retries=0)

        def get_weather(city: str) -> str:
            """Weather for a city."""
            return "18 C"

        called = llm.bind_tools([get_weather]).invoke("Weather in Paris?")
        [step] = steps_of(pool, 1)
    assert called.tool_calls[0]["name"] == "get_weather" and called.tool_calls[0]["args"] == {"city": "Paris"}
    assert step.tools[0]["function"]["name"] == "get_weather"


def test_curl_reads_the_sse_stream_and_sends_feedback(engine, tmp_path):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    with live_gateway(engine, tmp_path) as (base, pool):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi from curl"}], "max_tokens": 6,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        sse = subprocess.run([curl, "-sS", "-N", "-H", "content-type: application/json", "-d", body,
                              f"{base}/v1/chat/completions"], capture_output=True, text=True, timeout=60, check=True)
        events = [line[6:] for line in sse.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[0]["id"] == chunks[-1]["id"]
        feedback = subprocess.run([curl, "-sS", "-H", "content-type: application/json", "-d", json.dumps(
            {"completion_id": chunks[0]["id"], "reward": 1}), f"{base}/v1/feedback"], capture_output=True, text=True,
            timeout=60, check=True)
        [step] = steps_of(pool, 1)
        assert json.loads(feedback.stdout)["step_ids"] == [step.step_id]
        assert pool.show(step.step_id)["sample"]["reward"] == 1.0
    assert step.text == text
