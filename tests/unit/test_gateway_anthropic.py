"""`POST /v1/messages` over real HTTP with the official anthropic client: the same capture path as
chat (token-faithful steps, sessions), Anthropic's wire format and errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from clawr1.core.types import Generation
from clawr1.gateway import streaming
from clawr1.gateway.errors import anthropic_error_body
from clawr1.gateway.wire import anthropic as anthropic_wire
from tests.gateway_helpers import live_gateway, steps_of
from tests.scripted_engine import ScriptedEngine

WEATHER = {"name": "get_weather", "description": "Weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def server(engine, tmp_path):
    with live_gateway(engine, tmp_path) as served:
        yield served


def sdk() -> Any:
    """The anthropic SDK, imported by the tests that use it: its import takes ~2 s, which every
    test worker paid at collection, whichever tests it then ran."""
    import anthropic

    return anthropic


def client(base: str, key: str = "unused") -> Any:
    return sdk().Anthropic(base_url=base, api_key=key, max_retries=0)


def decoded(engine, step) -> str:
    return engine.tokenizer.decode(step.token_ids, skip_special_tokens=True)


def sse(base: str, body: dict) -> tuple[list[str], list[dict]]:
    """The raw stream's event names and data objects."""
    with httpx.stream("POST", f"{base}/v1/messages", json=body) as response:
        raw = response.read().decode()
    events = [chunk.split("\n") for chunk in raw.strip().split("\n\n")]
    return [lines[0].removeprefix("event: ") for lines in events], [json.loads(lines[1][6:]) for lines in events]


def test_message_is_recorded_token_faithfully(server, engine):
    base, pool = server
    # Recent SDKs dropped `temperature` from `create` (newer models fix it); older clients send it.
    reply = client(base).messages.create(model="smollm2", max_tokens=12, system="Be brief.",
                                         messages=[{"role": "user", "content": "Say something."}],
                                         extra_body={"temperature": 0.8})
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    [block] = reply.content
    [step] = steps_of(pool, 1)
    assert block.type == "text" and block.text == decoded(engine, step)
    assert step.step_id == reply.id + "-0"
    assert step.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(step.prompt_ids), len(step.token_ids))
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[step.finish_reason]
    assert step.temperature == 0.8 and step.turn_type == "main"


def test_streamed_text_is_the_recorded_text(server, engine):
    base, pool = server
    with client(base).messages.stream(model="m", max_tokens=16, extra_body={"temperature": 0},
                                      messages=[{"role": "user", "content": "Stream please."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    [step] = steps_of(pool, 1)
    assert text == final.content[0].text == decoded(engine, step)
    assert final.usage.output_tokens == len(step.token_ids) and final.stop_reason in ("end_turn", "max_tokens")


def test_sse_wire_format(server, engine):
    """`event: NAME` + `data: JSON` whose `type` is NAME, in Anthropic's order, with a ping."""
    base, pool = server
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    names, data = sse(base, body)
    assert [d["type"] for d in data] == names
    assert names[:2] == ["message_start", "ping"]
    rest = [n for n in names[2:] if n not in ("ping", "content_block_delta")]  # pings: keep-alive ticks
    assert rest == ["content_block_start", "content_block_stop", "message_delta", "message_stop"]
    [step] = steps_of(pool, 1)
    assert "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta") == decoded(engine, step)
    assert data[0]["message"]["usage"]["input_tokens"] == len(step.prompt_ids)


def test_a_spliced_text_delta_is_the_event_built_whole():
    for text in ["", " hello", 'a "quoted" \\ back\nslash', "é ✓ 🙂", streaming.MARK, "\x00\u2028"]:
        assert anthropic_wire.text_delta(text) == anthropic_wire.event(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}), text


def test_a_stream_past_the_timeout_ends_with_an_error_event_and_is_stored_aborted(engine, tmp_path):
    slow = ScriptedEngine(engine, "one two three four five six seven eight nine ten", delay=0.1)
    with live_gateway(slow, tmp_path, "gateway.request_timeout_s=0.45", "gateway.keepalive_s=0.04") as (base, pool):
        names, data = sse(base, {"model": "m", "max_tokens": 64, "stream": True,
                                 "messages": [{"role": "user", "content": "count"}]})
        [step] = steps_of(pool, 1)
    assert names[-1] == "error" and data[-1]["error"]["type"] == "api_error"
    assert "ping" in names[names.index("content_block_delta"):]  # keep-alive ticks between slow tokens
    assert step.finish_reason == "aborted" and 0 < len(step.token_ids) < 11
    streamed = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    assert streamed == decoded(engine, step)


def test_tool_use_and_tool_result_blocks_become_chat_messages(server, engine):
    base, pool = server
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "service down"}]},
                                     {"type": "text", "text": "Try again?"}]},
    ]
    client(base).messages.create(model="m", max_tokens=4, messages=conversation, tools=[WEATHER],
                                 system=[{"type": "text", "text": "You are a weather bot."}])
    [step] = steps_of(pool, 1)
    assert step.messages == [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: service down"},
        {"role": "user", "content": "Try again?"},
    ]
    assert step.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                                            "parameters": WEATHER["input_schema"]}}]
    prompt = engine.tokenizer.decode(step.prompt_ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert '"name": "get_weather"' in prompt.split("<|im_end|>")[0]  # the tool is described in the system prompt


def test_tool_calls_come_back_as_tool_use_and_the_session_continues(engine, tmp_path):
    with live_gateway(ScriptedEngine(engine, CALL), tmp_path) as (base, pool):
        c = client(base)
        history = [{"role": "user", "content": "Weather in Paris?"}]
        reply = c.messages.create(model="m", max_tokens=64, messages=history, tools=[WEATHER])
        assert reply.stop_reason == "tool_use"
        text, use = reply.content
        assert (text.text, use.name, use.input) == ("Let me check.", "get_weather", {"city": "Paris"})
        assert use.id.startswith("toolu_")
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
        with c.messages.stream(model="m", max_tokens=64, messages=history, tools=[WEATHER]) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
        assert final.content[1].input == {"city": "Paris"} and final.content[0].text == "Let me check."  # as the plain reply
        steps = sorted(steps_of(pool, 2), key=lambda s: s.turn_index)
    assert steps[0].session_id == steps[1].session_id and [s.turn_index for s in steps] == [0, 1]
    assert steps[1].messages[-1] == {"role": "tool", "tool_call_id": use.id, "content": "18 C"}


def test_a_call_whose_arguments_are_no_object_is_wrapped_and_its_replay_continues_the_session(engine, tmp_path):
    odd = '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'
    with live_gateway(ScriptedEngine(engine, odd), tmp_path) as (base, pool):
        history = [{"role": "user", "content": "Weather in Paris?"}]
        reply = client(base).messages.create(model="m", max_tokens=64, messages=history, tools=[WEATHER])
        [use] = reply.content
        assert use.input == {"arguments": "Paris"}  # `input` must be an object
        history += [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
        client(base).messages.create(model="m", max_tokens=64, messages=history, tools=[WEATHER])
        steps = sorted(steps_of(pool, 2), key=lambda s: s.turn_index)
    assert steps[0].session_id == steps[1].session_id and [s.turn_index for s in steps] == [0, 1]


def test_conversations_continue_their_sessions(server):
    base, pool = server
    c = client(base)
    histories = {"x": [{"role": "user", "content": "I am conversation X"}],
                 "y": [{"role": "user", "content": [{"type": "text", "text": "I am conversation Y"}]}]}
    for turn in range(2):
        for name, history in histories.items():
            reply = c.messages.create(model="m", max_tokens=4, messages=history, extra_body={"temperature": 0})
            history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                        {"role": "user", "content": f"{name} turn {turn + 1}"}]
    by_session: dict[str, list] = {}
    for step in steps_of(pool, 4):
        by_session.setdefault(step.session_id, []).append(step)
    assert sorted(sorted(s.turn_index for s in steps) for steps in by_session.values()) == [[0, 1], [0, 1]]


def test_session_ids_from_path_and_headers(server):
    base, pool = server
    ask = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    client(base + "/sess-A/prompt-1").messages.create(**ask)
    client(base).messages.create(**ask, extra_headers={"X-Session-Id": "sess-B", "X-Turn-Type": "side"})
    steps = {s.session_id: s for s in steps_of(pool, 2)}
    assert steps["sess-A"].prompt_id == "prompt-1" and steps["sess-B"].turn_type == "side"


@pytest.mark.parametrize("body,fragment", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ({"model": "m", "max_tokens": 4, "top_k": -1, "messages": [{"role": "user", "content": "x"}]}, "top_k"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"model": "m", "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "x"}]}, "server tool"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "JSON?"},
                                                  {"role": "assistant", "content": '{"answer":'}]}, "prefill"),
])
def test_bad_requests_get_anthropic_errors_and_store_nothing(server, body, fragment):
    base, pool = server
    response = httpx.post(f"{base}/v1/messages", json=body)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"]
    assert pool.stats()["steps"] == 0


def test_x_api_key_and_bearer_are_accepted_and_checked(engine, tmp_path):
    with live_gateway(engine, tmp_path, 'gateway.api_keys=["sk-good-key"]') as (base, pool):
        ask = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(sdk().AuthenticationError) as refused:
            client(base, "sk-bad").messages.create(**ask)
        assert refused.value.body["error"]["type"] == "authentication_error"
        client(base, "sk-good-key").messages.create(**ask)  # x-api-key
        sdk().Anthropic(base_url=base, auth_token="sk-good-key", max_retries=0).messages.create(**ask)  # Bearer
        assert len(steps_of(pool, 2)) == 2


def test_translation_of_a_parsed_tool_call(engine):
    parsed = engine.parse(CALL)
    gen = Generation(prompt_ids=[1, 2, 3], token_ids=[4, 5], finish_reason="stop")
    body = anthropic_wire.message_body("msg_1", "m", gen, parsed)
    message = sdk().types.Message.model_validate(body)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert body["content"][1] == {"type": "tool_use", "id": "toolu_" + parsed.tool_calls[0].id.removeprefix("call_"),
                                  "name": "get_weather", "input": {"city": "Paris"}}
    assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 2)
    cut = Generation(prompt_ids=[1], token_ids=[4], finish_reason="stop", text="ab END", stop_match=" END")
    plain = anthropic_wire.message_body("msg_2", "m", cut, engine.parse(cut.content))
    assert (plain["stop_reason"], plain["stop_sequence"], plain["content"]) == \
        ("stop_sequence", " END", [{"type": "text", "text": "ab"}])
    assert anthropic_error_body(429, "busy", "engine_overloaded")["error"]["type"] == "overloaded_error"
    assert anthropic_error_body(504, "slow")["error"]["type"] == "api_error"
