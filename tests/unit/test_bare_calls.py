"""A reply that is only a bare JSON call of an offered tool (as Qwen2.5-Coder-0.5B writes most of
its calls) is a tool call, plain or streamed; JSON that names no offered tool, has other keys or
comes with text stays text, and a stream that held it back sends it whole."""

from __future__ import annotations

import json

import httpx
import pytest

from clawr1.engine.chat import ChatFormat, could_be_bare_call
from tests.gateway_helpers import live_gateway, steps_of
from tests.scripted_engine import ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CALL = '{"name": "calculator", "arguments": {"expression": "27 * 52"}}'


@pytest.mark.parametrize("reply", [CALL, f"  {CALL}\n", f"```json\n{CALL}\n```", f"[{CALL}, {CALL}]",
                                   f"{CALL}\n{CALL}\n\n{CALL}",  # one a line, as the template writes several
                                   '{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}'])
def test_a_bare_call_of_an_offered_tool_is_a_call(reply):
    parsed = ChatFormat.parse(reply, TOOLS)
    assert parsed.content is None and parsed.tool_calls and all(c.name == "calculator" for c in parsed.tool_calls)
    assert all(isinstance(json.loads(c.arguments), dict) for c in parsed.tool_calls)


@pytest.mark.parametrize("reply,tools", [
    (CALL, None),  # no tools offered
    ('{"name": "search", "arguments": {}}', TOOLS),  # not an offered tool
    ('{"name": "calculator", "arguments": {}, "required": ["x"]}', TOOLS),  # more than a call
    (f"Here you go: {CALL}", TOOLS),  # text with it
    ('{"name": "calculator", "arguments": {', TOOLS),  # cut short
    (f'{CALL}\n{{"name": "calculator", "arguments": {{"expr', TOOLS),  # the next call cut short
    (f"{CALL}\nThe result is 1404.", TOOLS),  # a call, then an answer made up before the tool ran
    (f'{CALL}\n{{"name": "search", "arguments": {{}}}}', TOOLS),  # the second tool not offered
    ('{"answer": 1404}', TOOLS),
])
def test_anything_else_stays_text(reply, tools):
    assert ChatFormat.parse(reply, tools).content == reply and not ChatFormat.parse(reply, tools).tool_calls


def test_streams_hold_back_what_may_still_be_a_call():
    assert all(could_be_bare_call(t) for t in ("{", " [", "`", "``", "```json\n{"))
    assert not any(could_be_bare_call(t) for t in ("", "Sure", " The answer", "`x`"))


@pytest.mark.parametrize("stream", [False, True])
def test_the_gateway_answers_a_bare_call_as_a_tool_call(engine, tmp_path, stream):
    with live_gateway(ScriptedEngine(engine, CALL), tmp_path) as (base, pool):
        body = {"model": "m", "messages": [{"role": "user", "content": "What is 27 * 52?"}], "tools": TOOLS,
                "stream": stream}
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            message = response.json()["choices"][0]["message"]
            content, calls, finish = message["content"], message["tool_calls"], response.json()["choices"][0][
                "finish_reason"]
        assert not content and finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("calculator", {"expression": "27 * 52"})]
        [step] = steps_of(pool, 1)
        assert step.text == CALL  # the tokens as sampled: the call's form is the model's to learn
    with live_gateway(ScriptedEngine(engine, '{"answer": 1404}'), tmp_path / "text") as (base, _):
        body = {"model": "m", "messages": [{"role": "user", "content": "JSON?"}], "tools": TOOLS, "stream": stream}
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        text = response.text if stream else response.json()["choices"][0]["message"]["content"]
        assert "1404" in text
