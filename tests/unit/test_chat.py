import json

import pytest
from transformers import AutoTokenizer

from clawr1.core.types import InvalidRequestError
from clawr1.engine.chat import ChatFormat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))


def test_render_uses_the_models_chat_template(chat):
    ids = chat.render([{"role": "user", "content": "Hi there"}])
    text = chat.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(chat.tokenizer.bos_token_id) == 3  # no BOS added twice


def test_content_parts_and_developer_role(chat):
    a = chat.render([{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}])
    b = chat.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    assert a == b


def test_tools_go_into_the_system_prompt_for_smollm2(chat):
    assert not chat.native_tools
    text = chat.tokenizer.decode(chat.render([{"role": "user", "content": "Weather in Oslo?"}], TOOLS))
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert "You are a helpful AI assistant named SmolLM" not in text  # our system message replaces the default


def test_tool_call_history_round_trips(chat):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C, snow"},
    ]
    text = chat.tokenizer.decode(chat.render(messages, TOOLS))
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|im_start|>tool\n3 C, snow<|im_end|>" in text


def test_parse_tool_calls():
    parsed = ChatFormat.parse('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert parsed.content == "Let me check."
    assert len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")
    two = ChatFormat.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b"}</tool_call>')
    assert [c.name for c in two.tool_calls] == ["a", "b"] and two.content is None
    # A model that stops at end-of-turn before the closing tag still made a call.
    assert ChatFormat.parse('<tool_call>{"name": "a", "arguments": {"x": 1}}').tool_calls[0].name == "a"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": Oslo}}</tool_call>',
    "<tool_call>not json at all</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>["get_weather"]</tool_call>',
])
def test_bad_tool_call_is_plain_content(text):
    parsed = ChatFormat.parse(text)
    assert parsed.tool_calls == () and parsed.content == text


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
    ([{"role": "user", "content": 42}], "messages[0].content"),
])
def test_bad_messages_are_clear_errors(chat, messages, param):
    with pytest.raises(InvalidRequestError) as info:
        chat.render(messages)
    assert info.value.param == param


def test_a_model_directorys_tokenizer_is_loaded_once_until_its_files_change(tiny_model_dir, tmp_path):
    """The engine, its front end and the trainer's policy share one tokenizer per directory
    (`engine/tokenizer.py`); a tokenizer rewritten in place is loaded again, and at most
    `KEEP` stay loaded."""
    import shutil

    from clawr1.engine import tokenizer as tokenizers
    from clawr1.engine.frontend import Frontend

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    first = tokenizers.load_tokenizer(model)
    assert tokenizers.load_tokenizer(str(model)) is first and Frontend(model).tokenizer is first
    settings = model / "tokenizer_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "model_max_length": 77}))
    changed = tokenizers.load_tokenizer(model)
    assert changed is not first and changed.model_max_length == 77
    for i in range(tokenizers.KEEP):  # as many other directories push the changed one out
        tokenizers.load_tokenizer(shutil.copytree(model, tmp_path / f"other-{i}"))
    assert tokenizers.load_tokenizer(model) is not changed


def test_a_shared_tokenizer_has_no_padding_or_truncation_for_an_encode_to_clear(tiny_model_dir, tmp_path):
    """A tokenizer.json may set padding and truncation; an encode without them would clear them, a
    write on an instance the engine and trainer threads share. They are cleared at load instead."""
    import shutil

    from clawr1.engine.tokenizer import load_tokenizer

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = load_tokenizer(model)
    assert tokenizer.backend_tokenizer.truncation is None and tokenizer.backend_tokenizer.padding is None
    assert len(tokenizer("one two three four five six seven", add_special_tokens=False)["input_ids"]) == 7


def test_json_nested_deeper_than_the_parser_goes_is_kept_as_text_not_an_error():
    """A client's tool-call arguments, or a model's tool call, nested past Python's recursion limit:
    kept as the text it is (as malformed JSON is), never a RecursionError (a 500 mid-request)."""
    from clawr1.core.messages import arguments_value
    from clawr1.engine.chat import ChatFormat

    deep = "[" * 5000 + "]" * 5000
    assert arguments_value(deep) == deep
    reply = '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"
    parsed = ChatFormat.parse(reply)
    assert parsed.content == reply and not parsed.tool_calls
