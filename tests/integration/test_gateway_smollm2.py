"""The official openai client with tools against a live gateway on the real SmolLM2: the model calls
a tool (plain and streamed), the agent answers it, and the turns stay one session."""

from __future__ import annotations

import json

import openai

from tests.gateway_helpers import live_gateway, steps_of

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _call(i: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


# Two worked examples: a 135M model follows the pattern, so the call is deterministic at temperature 0.
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"}, _call(1, "Paris"),
    {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny in Paris."},
    {"role": "user", "content": "Weather in Rome?"}, _call(2, "Rome"),
    {"role": "tool", "tool_call_id": "c2", "content": "25C, clear"},
    {"role": "assistant", "content": "It is 25C and clear in Rome."},
    {"role": "user", "content": "Weather in London?"},
]


def test_openai_tool_calls_plain_and_streamed(real_engine, tmp_path):
    with live_gateway(real_engine, tmp_path) as (base, pool):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        ask = {"model": "smollm2", "tools": TOOLS, "temperature": 0, "max_tokens": 60}
        chunks = list(client.chat.completions.create(messages=HISTORY, stream=True, **ask))
        streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [tc.function.name for tc in streamed] == ["get_weather"]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""  # markup held back
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

        reply = client.chat.completions.create(messages=HISTORY, **ask)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "London"}

        # The agent runs the tool and continues (with its own call id, as OpenClaw rewrites them).
        rewritten = {**choice.message.model_dump(exclude_none=True), "tool_calls": [
            {**call.model_dump(), "id": "toolu_rewritten"}]}
        follow = HISTORY + [rewritten, {"role": "tool", "tool_call_id": "toolu_rewritten", "content": "12C, rain"}]
        client.chat.completions.create(messages=follow, **ask)

        steps = steps_of(pool, 3)
        for step in steps:
            assert step.tools == TOOLS
            assert real_engine.tokenizer.decode(step.token_ids, skip_special_tokens=True) == step.text
        [first] = pool.get_steps([reply.id + "-0"])  # the latest reply to HISTORY: the one continued
        assert "<tool_call>" in first.text
        continued = next(s for s in steps if len(s.messages) == len(follow))
        assert continued.session_id == first.session_id and continued.turn_index == 1
        assert pool.get_steps([first.step_id])[0].next_state[-1]["content"] == "12C, rain"
        assert len({s.session_id for s in steps}) == 2  # the streamed call was its own conversation
