"""`POST /v1/messages` (and `/{session}/{prompt}/v1/messages`): the Anthropic Messages API, plain
and SSE, on chat's capture path (`pipeline.py`, `translated.py`); first the format itself,
translated to and from the OpenAI chat shape that the engine renders and the pool stores.

In: `system` becomes the first system message; an assistant message's `text` blocks become its
content and its `tool_use` blocks its `tool_calls` (input as a JSON string); a user message's
`tool_result` blocks become `tool` messages placed before its remaining text, as chat requires. A
`tool_result` with `is_error: true` is rendered as "Error: " + its text, so the model can tell.
Blocks a text model cannot take (images, documents, thinking, server tools) are refused with 400.
Out: content becomes a text block, tool calls become `tool_use` blocks (ids `toolu_...`).

Point an Anthropic client at `http://127.0.0.1:8000` (or `.../{session_id}/{prompt_id}`). The key
may come as `x-api-key` (what the SDKs send) or `Authorization: Bearer`. Every error is answered in
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, since Anthropic clients read
nothing else.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from clawr1.core.messages import arguments_object
from clawr1.core.types import EngineError, Generation, ParsedCompletion, SamplingDefaults, SamplingParams, ToolCall
from clawr1.gateway import schema
from clawr1.gateway.errors import APIError, anthropic_error_body
from clawr1.gateway.ids import new_id
from clawr1.gateway.pipeline import Exchange, Job, Wire, handle
from clawr1.gateway.schema import settings
from clawr1.gateway.service import Caller, Gateway
from clawr1.gateway.stream_text import tail
from clawr1.gateway.streaming import spliced
from clawr1.gateway.wire.translated import chat_job, text_content


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


router = APIRouter()


class Messages(Wire):
    request_model = MessagesRequest

    def token(self, request: Request) -> str:
        """`x-api-key` first (the Anthropic SDKs' header), else the Bearer token."""
        return request.headers.get("x-api-key", "").strip() or super().token(request)

    def prepare(self, gw: Gateway, req: MessagesRequest, caller: Caller, headers: dict[str, str],
                path_ids: tuple[str, str] | None) -> Job:
        return chat_job(gw, req, caller, new_id("msg_"), self.messages(req), req.chat_tools(), req.sampling(gw.sampling_defaults),
                        headers, path_ids)

    def error_body(self, exc: APIError | EngineError) -> dict[str, Any]:
        return anthropic_error_body(exc.status, exc.message, exc.code)

    def body(self, ex: Exchange, gens: list[Generation], parsed: list[ParsedCompletion]) -> dict[str, Any]:
        return message_body(ex.job.reply_id, ex.job.req.model, gens[0], parsed[0])

    async def events(self, ex: Exchange) -> AsyncIterator[str]:
        """message_start, ping, the text block's deltas as sampled (tool-call markup held back), then
        one block per tool call (its input as a single `input_json_delta`), message_delta,
        message_stop. A keep-alive tick is a `ping`."""
        opened = False  # the text block (index 0) has started
        sent = ""
        yield event("message_start", {"message": {
            "id": ex.job.reply_id, "type": "message", "role": "assistant", "model": ex.job.req.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(len(ex.job.prompts[0]), 0)}})
        yield event("ping", {})
        async for delta in ex.deltas():
            if delta is None:
                yield event("ping", {})
                continue
            if not opened:
                opened = True
                yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            sent += delta
            yield text_delta(delta)
        gen, parsed = await ex.finish()
        rest = tail(gen, parsed, sent)
        if not opened and (rest or not parsed.tool_calls):  # a text block always, unless only tool calls
            opened = True
            yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        if rest:
            yield text_delta(rest)
        if opened:
            yield event("content_block_stop", {"index": 0})
        for index, tool_call in enumerate(parsed.tool_calls, start=int(opened)):
            block = tool_use(tool_call)
            yield event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            yield event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
            yield event("content_block_stop", {"index": index})
        yield event("message_delta", {"delta": {"stop_reason": stop_reason(gen, parsed),
                                                     "stop_sequence": stop_sequence(gen, parsed)},
                                           "usage": {"output_tokens": len(gen.token_ids)}})
        yield event("message_stop", {})

    def stream_error(self, ex: Exchange, exc: APIError | EngineError) -> str:
        return event("error", self.error_body(exc))


MESSAGES = Messages()


@router.post("/v1/messages", openapi_extra=schema.request_body(MessagesRequest))
async def messages(request: Request) -> Any:
    return await handle(request, MESSAGES, None)


@router.post("/{session_id}/{prompt_id}/v1/messages", openapi_extra=schema.request_body(MessagesRequest))
async def messages_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, MESSAGES, (session_id, prompt_id))
