"""`POST /v1/responses` over real HTTP with the official openai client: the same capture path as
chat (token-faithful steps, sessions), the Responses wire format, stateless refusals."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.responses import Response

from clawr1.core.types import Generation
from clawr1.gateway import streaming
from clawr1.gateway.wire import responses as responses_wire
from tests.gateway_helpers import live_gateway, steps_of
from tests.scripted_engine import ScriptedEngine

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def server(engine, tmp_path):
    with live_gateway(engine, tmp_path) as served:
        yield served


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def decoded(engine, step) -> str:
    return engine.tokenizer.decode(step.token_ids, skip_special_tokens=True)


def test_response_is_recorded_token_faithfully(server, engine):
    base, pool = server
    reply = client(base).responses.create(model="smollm2", input="Say something.", instructions="Be brief.",
                                          max_output_tokens=12, temperature=0.8)
    assert reply.object == "response" and reply.id.startswith("resp_")
    [step] = steps_of(pool, 1)
    [item] = reply.output
    assert item.type == "message" and reply.output_text == decoded(engine, step)
    assert step.step_id == reply.id + "-0"
    assert step.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(step.prompt_ids), len(step.token_ids))
    cut = step.finish_reason == "length"
    assert reply.status == ("incomplete" if cut else "completed")
    assert (reply.incomplete_details is not None) == cut and step.temperature == 0.8


def test_streamed_events_carry_the_recorded_text(server, engine):
    base, pool = server
    events = list(client(base).responses.create(model="m", input=[{"role": "user", "content": "Stream please."}],
                                                max_output_tokens=16, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [step] = steps_of(pool, 1)
    assert text == decoded(engine, step) == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == len(step.token_ids)


def test_spliced_text_deltas_are_the_events_built_whole_in_sequence():
    texts = ["", " hello", 'a "quoted" \\ back\nslash', "é ✓ 🙂", streaming.MARK, "\x00\u2028"]
    spliced, whole = responses_wire.Events(), responses_wire.Events()
    for events in (spliced, whole):
        events("response.created", response={})
    delta = spliced.text_deltas("msg_1")
    for text in texts:
        assert delta(text) == whole("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0,
                                    delta=text, logprobs=[]), text
    assert spliced("response.completed") == whole("response.completed")  # the numbering goes on


def test_a_stream_past_the_timeout_ends_with_response_failed_and_is_stored_aborted(engine, tmp_path):
    slow = ScriptedEngine(engine, "one two three four five six seven eight nine ten", delay=0.1)
    with live_gateway(slow, tmp_path, "gateway.request_timeout_s=0.45", "gateway.keepalive_s=0.04") as (base, pool):
        events = list(client(base).responses.create(model="m", input="count", stream=True))
        [step] = steps_of(pool, 1)
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "server_error"
    assert step.finish_reason == "aborted" and 0 < len(step.token_ids) < 11
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == decoded(engine, step)


def test_function_call_items_become_chat_messages(server, engine):
    base, pool = server
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]
    client(base).responses.create(model="m", input=items, tools=[WEATHER], instructions="Weather bot.",
                                  max_output_tokens=4)
    [step] = steps_of(pool, 1)
    assert step.messages == [
        {"role": "system", "content": "Weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    assert step.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                                            "parameters": WEATHER["parameters"]}}]
    prompt = engine.tokenizer.decode(step.prompt_ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt


def test_tool_calls_come_back_as_function_call_items_and_the_session_continues(engine, tmp_path):
    with live_gateway(ScriptedEngine(engine, CALL), tmp_path) as (base, pool):
        c = client(base)
        history: list = [{"role": "user", "content": "Weather in Paris?"}]
        reply = c.responses.create(model="m", input=history, tools=[WEATHER])
        message, call = reply.output
        assert (message.type, reply.output_text, call.type, call.name, call.arguments) == \
            ("message", "Let me check.", "function_call", "get_weather", '{"city": "Paris"}')
        history += [item.model_dump(exclude_none=True) for item in reply.output]
        history.append({"type": "function_call_output", "call_id": call.call_id, "output": "18 C"})
        events = list(c.responses.create(model="m", input=history, tools=[WEATHER], stream=True))
        final = events[-1].response
        assert events[-1].type == "response.completed"
        assert [i.type for i in final.output] == ["message", "function_call"]
        assert "response.function_call_arguments.done" in [e.type for e in events]
        assert final.output[1].arguments == '{"city": "Paris"}'
        assert final.output_text == reply.output_text  # streamed or not, the same text
        steps = sorted(steps_of(pool, 2), key=lambda s: s.turn_index)
    assert steps[0].session_id == steps[1].session_id and [s.turn_index for s in steps] == [0, 1]
    assert steps[1].messages[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}


def test_conversations_continue_their_sessions(server):
    base, pool = server
    c = client(base)
    histories = {"x": [{"role": "user", "content": "I am conversation X"}],
                 "y": [{"role": "user", "content": [{"type": "input_text", "text": "I am conversation Y"}]}]}
    for turn in range(2):
        for name, history in histories.items():
            reply = c.responses.create(model="m", input=history, max_output_tokens=4, temperature=0)
            history += [item.model_dump(exclude_none=True) for item in reply.output]
            history.append({"role": "user", "content": f"{name} turn {turn + 1}"})
    by_session: dict[str, list] = {}
    for step in steps_of(pool, 4):
        by_session.setdefault(step.session_id, []).append(step)
    assert sorted(sorted(s.turn_index for s in steps) for steps in by_session.values()) == [[0, 1], [0, 1]]


def test_session_ids_from_path_and_headers(server):
    base, pool = server
    client(base + "/sess-A/prompt-1").responses.create(model="m", input="hi", max_output_tokens=2)
    client(base).responses.create(model="m", input="hi", max_output_tokens=2,
                                  extra_headers={"X-Session-Id": "sess-B", "X-Turn-Type": "side"})
    steps = {s.session_id: s for s in steps_of(pool, 2)}
    assert steps["sess-A"].prompt_id == "prompt-1" and steps["sess-B"].turn_type == "side"


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_requests_get_openai_errors_and_store_nothing(server, body, param):
    base, pool = server
    response = httpx.post(f"{base}/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert pool.stats()["steps"] == 0


def test_translation_of_a_parsed_tool_call(engine):
    parsed = engine.parse(CALL)
    gen = Generation(prompt_ids=[1, 2, 3], token_ids=[4, 5], finish_reason="stop")
    req = responses_wire.ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": [WEATHER]})
    output = responses_wire.output_items("resp_1", gen, parsed)
    body = responses_wire.response_object("resp_1", req, 0, responses_wire.status(gen, parsed), output,
                                          responses_wire.usage(3, 2))
    response = Response.model_validate(body)
    assert response.output_text == "Let me check." and response.status == "completed"
    call = response.output[1]
    assert (call.type, call.call_id, call.name, call.arguments) == \
        ("function_call", parsed.tool_calls[0].id, "get_weather", '{"city": "Paris"}')
    assert response.usage.total_tokens == 5
    cut = Generation(prompt_ids=[1], token_ids=[4], finish_reason="length", text="ab")
    plain = responses_wire.output_items("resp_2", cut, engine.parse("ab"))
    assert responses_wire.status(cut, engine.parse("ab")) == "incomplete" and plain[0]["status"] == "incomplete"
