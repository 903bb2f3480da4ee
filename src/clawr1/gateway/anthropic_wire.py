"""The Anthropic Messages wire format, translated to and from the OpenAI chat shape that the engine
renders and the pool stores.

In: `system` becomes the first system message; an assistant message's `text` blocks become its
content and its `tool_use` blocks its `tool_calls` (input as a JSON string); a user message's
`tool_result` blocks become `tool` messages placed before its remaining text, as chat requires. A
`tool_result` with `is_error: true` is rendered as "Error: " + its text, so the model can tell.
Blocks a text model cannot take (images, documents, thinking, server tools) are refused with 400.
Out: content becomes a text block, tool calls become `tool_use` blocks (ids `toolu_...`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from clawr1.core.messages import arguments_object
from clawr1.core.types import Generation, ParsedCompletion, SamplingDefaults, SamplingParams, ToolCall
from clawr1.gateway.errors import APIError
from clawr1.gateway.schema import settings
from clawr1.gateway.streaming import spliced
from clawr1.gateway.translated import text_content


class AnthropicTool(BaseModel):
    """A client tool. Server tools (`web_search_...`, `bash_...`) run at Anthropic, not here."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is a server tool, which this gateway does not run; "
                             "give client tools with name, description and input_schema")
        return value


class AnthropicMessage(BaseModel):
    """A turn: a string, or content blocks (`text`, `tool_use` from the assistant, `tool_result`
    from the user; each is checked in `_chat`)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, max_length=128)


class MessagesRequest(BaseModel):
    """What we read of `POST /v1/messages`; unknown fields (`metadata` included) are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int = Field(ge=1, le=1 << 24)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=100_000)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=1024)
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    stop_sequences: list[str] | None = Field(None, max_length=4)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def sampling(self, defaults: SamplingDefaults) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, stop=tuple(self.stop_sequences or ()),
                              **settings(self, defaults))

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Tools in chat's shape, or None when there are none or `tool_choice` is `none`. `any` and
        `tool` are rendered like `auto`: the engine cannot force a call (chat's `required` neither)."""
        kind = self.tool_choice.type if self.tool_choice else "auto"
        if not self.tools or kind == "none":
            return None
        return [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                  **({"description": t.description} if t.description else {})}}
                for t in self.tools]

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.messages[-1].role == "assistant":
            # Anthropic's prefill continues that turn; the engine would close it and open another
            # (and the pool would store a two-assistant prompt as a training sample): refused.
            raise _bad("a final assistant message (prefill) is not supported: end with a user message",
                       f"messages.{len(self.messages) - 1}.role")
        out: list[dict[str, Any]] = []
        system = [self.system] if isinstance(self.system, str) else _texts(self.system or [], "system")
        if any(system):
            out.append({"role": "system", "content": text_content(system)})
        for i, message in enumerate(self.messages):
            out += _chat(message.model_dump(), f"messages.{i}")
        return out


def _chat(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user turn with tool results becomes several)."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or an array of content blocks", f"{where}.content")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_field(block, "text", str, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": _field(block, "id", str, at), "type": "function", "function": {
                "name": _field(block, "name", str, at), "arguments": json.dumps(_field(block, "input", dict, at))}})
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            text = result if isinstance(result, str) else "".join(_texts(result or [], f"{at}.content"))
            out.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, at),
                        "content": "Error: " + text if block.get("is_error") else text})
        else:
            allowed = "text, tool_use" if role == "assistant" else "text, tool_result"
            raise _bad(f"{at}.type {kind!r} is not supported in a {role} message (a text model takes {allowed})",
                       f"{at}.type")
    if role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": text_content(texts)}
        if calls:
            reply["tool_calls"] = calls
        return [reply]
    if texts or not out:
        out.append({"role": "user", "content": text_content(texts) or ""})
    return out


def _texts(blocks: Any, where: str) -> list[str]:
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be a string or an array of text blocks", where)
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"{where}.{j}.type must be 'text' (a text model), got {kind!r}", f"{where}.{j}.type")
        texts.append(_field(block, "text", str, f"{where}.{j}"))
    return texts


def _field(block: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = block.get(name)
    if not isinstance(value, kind):
        raise _bad(f"{where}.{name} must be a {'string' if kind is str else 'JSON object'}", f"{where}.{name}")
    return value


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


# ---- out ------------------------------------------------------------------------------------
def tool_use(call: ToolCall) -> dict[str, Any]:
    """`input` must be an object; arguments that are not one (a model's odd output) are wrapped."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": arguments_object(call.arguments)}


def stop_reason(gen: Generation, parsed: ParsedCompletion) -> str:
    if parsed.tool_calls:
        return "tool_use"
    if gen.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if gen.stop_match is not None else "end_turn"


def stop_sequence(gen: Generation, parsed: ParsedCompletion) -> str | None:
    return gen.stop_match if stop_reason(gen, parsed) == "stop_sequence" else None


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def message_body(mid: str, model: str, gen: Generation, parsed: ParsedCompletion) -> dict[str, Any]:
    """The whole reply: a text block (always, unless the reply is only tool calls), then tool uses."""
    content: list[dict[str, Any]] = []
    if parsed.content or not parsed.tool_calls:
        content.append({"type": "text", "text": parsed.content or ""})
    content += [tool_use(c) for c in parsed.tool_calls]
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(gen, parsed), "stop_sequence": stop_sequence(gen, parsed),
            "usage": usage(len(gen.prompt_ids), len(gen.token_ids))}


def event(name: str, body: dict[str, Any]) -> str:
    """One SSE event as Anthropic sends it: the name twice, as `event:` and as the body's `type`."""
    return f"event: {name}\ndata: " + json.dumps({"type": name, **body}, separators=(",", ":")) + "\n\n"


text_delta = spliced(lambda text: event("content_block_delta",
                                        {"index": 0, "delta": {"type": "text_delta", "text": text}}))
"""The text block's `content_block_delta` event, the event of nearly every token."""
