"""`POST /v1/responses` (and `/{session}/{prompt}/v1/responses`): the OpenAI Responses API, plain
and SSE, on chat's capture path (`pipeline.py`, `translated.py`); first the format itself,
translated to and from the chat shape that the engine renders and the pool stores. Errors are
OpenAI-shaped, as for chat; a stream that fails ends with `response.failed`.

In: `instructions` becomes the first system message; message items keep their role (`developer` is
rendered as system, as in chat) with their `input_text`/`output_text` parts as text; consecutive
`function_call` items join the assistant message before them as its `tool_calls` (so a replayed
`response.output` is the very reply the matcher learnt); `function_call_output` items become `tool`
messages. Out: content becomes a `message` item with one `output_text` part, tool calls become
`function_call` items.

Stateless: `previous_response_id`, `conversation` and `background` are refused with 400 (nothing is
kept to continue from; send the whole conversation in `input`, and history matching still joins a
stock client's turns into one session). Unknown fields (`store`, `text`, `reasoning`, `metadata`,
`parallel_tool_calls`, ...) are ignored, as chat ignores what it does not read.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from clawr1.core.types import EngineError, Generation, ParsedCompletion, SamplingDefaults, SamplingParams
from clawr1.gateway import schema
from clawr1.gateway.errors import APIError
from clawr1.gateway.ids import new_id
from clawr1.gateway.pipeline import Exchange, Job, Wire, handle
from clawr1.gateway.schema import settings
from clawr1.gateway.service import Caller, Gateway
from clawr1.gateway.stream_text import tail
from clawr1.gateway.streaming import MARK
from clawr1.gateway.wire.translated import chat_job, text_content

TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(BaseModel):
    """The Responses API's flat function tool (`{"type": "function", "name", ...}`)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    """`{"type": "function", "name": ...}`: rendered like `auto` (the engine cannot force a call)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=1024)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1 << 24)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    user: str | None = Field(None, max_length=4096)  # OpenAI's end-user id (the memory's user)
    safety_identifier: str | None = Field(None, max_length=4096)  # its successor, read the same way
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if not value or not isinstance(value, (str, list)):
            raise ValueError("input must be a non-empty string or array of input items")
        return value

    def refuse_state(self) -> None:
        """The stateful parts of the API: this gateway keeps no responses to continue from."""
        for name in ("previous_response_id", "conversation", "background"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported: this gateway is stateless; send the whole "
                                    "conversation in `input` (its turns still join one session)",
                               param=name, code="unsupported_parameter")

    def sampling(self, default_max_tokens: int, defaults: SamplingDefaults) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_output_tokens or default_max_tokens, **settings(self, defaults))

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Chat-shaped tools, or None with `tool_choice: "none"`; other choices render like `auto`
        (the engine cannot force a call, as with chat's `required`)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
                for t in self.tools]

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            where = f"input[{i}]"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise _bad(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               f"{where}.role")
                out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                function = {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}
                call = {"id": _string(item, "call_id", where), "type": "function", "function": function}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                            "content": _text(item.get("output"), f"{where}.output") or ""})
            else:
                raise _bad(f"{where}.type {kind!r} is not supported (message, function_call and "
                           "function_call_output items, text only)", f"{where}.type")
        return out


def _text(content: Any, where: str) -> str | list[dict[str, str]] | None:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]: content part of type {kind!r} is not supported by a text model "
                       "(input_text / output_text)", f"{where}[{j}]")
        texts.append(part["text"])
    return text_content(texts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    if not isinstance(item.get(name), str):
        raise _bad(f"{where}.{name} must be a string", f"{where}.{name}")
    return item[name]


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


# ---- out ------------------------------------------------------------------------------------
def status(gen: Generation, parsed: ParsedCompletion) -> str:
    """`incomplete` when `max_output_tokens` cut the reply (tool calls win, as in chat's finish)."""
    return "incomplete" if gen.finish_reason == "length" and not parsed.tool_calls else "completed"


def message_item(item_id: str, text: str, state: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": state, "role": "assistant", "content": [part]}


def function_call_items(rid: str, parsed: ParsedCompletion, first_index: int) -> list[dict[str, Any]]:
    return [{"type": "function_call", "id": f"fc_{rid.removeprefix('resp_')}_{first_index + i}", "call_id": c.id,
             "name": c.name, "arguments": c.arguments, "status": "completed"} for i, c in enumerate(parsed.tool_calls)]


def output_items(rid: str, gen: Generation, parsed: ParsedCompletion) -> list[dict[str, Any]]:
    """A message item (always, unless the reply is only tool calls), then one item per call."""
    items = []
    if parsed.content or not parsed.tool_calls:
        items.append(message_item(message_id(rid), parsed.content or "", status(gen, parsed)))
    return items + function_call_items(rid, parsed, len(items))


def message_id(rid: str) -> str:
    return "msg_" + rid.removeprefix("resp_")


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def response_object(rid: str, req: ResponsesRequest, created_at: int, state: str, output: list[dict[str, Any]],
                    usage_: dict[str, Any] | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object (also the body of the lifecycle events); `store` is false: nothing is
    kept to retrieve or continue from."""
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": state, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if state == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
        "output": output, "parallel_tool_calls": True, "previous_response_id": None, "store": False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "tool_choice": _choice(req.tool_choice),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": {"format": {"type": "text"}},
        "truncation": "disabled", "metadata": {}, "usage": usage_,
    }


def _choice(choice: str | FunctionChoice | None) -> Any:
    return choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto"


class Events:
    """SSE events with the `sequence_number` every Responses event carries."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, /, **body: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return f"event: {kind}\ndata: " + json.dumps(data, separators=(",", ":")) + "\n\n"

    def text_deltas(self, item_id: str) -> Callable[[str], str]:
        """`self("response.output_text.delta", ...)` for the message item's text, the event of
        nearly every token: as `streaming.spliced`, with the sequence number put in too (the
        template is cut there as well)."""
        template = self("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                        delta=MARK, logprobs=[])
        self.sequence -= 1  # the template is not sent
        head, rest = template.split(f'"sequence_number":{self.sequence},', 1)
        middle, tail = rest.rsplit(json.dumps(MARK), 1)  # the delta comes after the item id
        head += '"sequence_number":'

        def delta(text: str) -> str:
            number, self.sequence = self.sequence, self.sequence + 1
            return f"{head}{number},{middle}{json.dumps(text)}{tail}"

        return delta


router = APIRouter()


class Responses(Wire):
    request_model = ResponsesRequest

    def prepare(self, gw: Gateway, req: ResponsesRequest, caller: Caller, headers: dict[str, str],
                path_ids: tuple[str, str] | None) -> Job:
        req.refuse_state()
        return chat_job(gw, req, caller, new_id("resp_"), self.messages(req), req.chat_tools(),
                        req.sampling(gw.config.engine.default_max_tokens, gw.sampling_defaults), headers, path_ids)

    def body(self, ex: Exchange, gens: list[Generation], parsed: list[ParsedCompletion]) -> dict[str, Any]:
        gen, rid = gens[0], ex.job.reply_id
        output, used = output_items(rid, gen, parsed[0]), usage(len(gen.prompt_ids), len(gen.token_ids))
        return response_object(rid, ex.job.req, ex.job.created, status(gen, parsed[0]), output, used)

    async def events(self, ex: Exchange) -> AsyncIterator[str]:
        """response.created / in_progress; the message item's text deltas as sampled (opened at the
        first one; tool-call markup held back); one function_call item per call; then
        response.completed (or response.incomplete when `max_output_tokens` cut it). A keep-alive
        tick is an SSE comment, which clients skip."""
        req, rid, created_at = ex.job.req, ex.job.reply_id, ex.job.created
        ev = ex.state = Events()  # the error event continues its sequence numbers
        mid = message_id(rid)
        opened = False  # the message item (output 0) has started
        sent = ""

        def open_message() -> list[str]:
            item = {**message_item(mid, "", "in_progress"), "content": []}
            return [ev("response.output_item.added", output_index=0, item=item),
                    ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

        delta = ev.text_deltas(mid)
        skeleton = response_object(rid, req, created_at, "in_progress", [], None)
        yield ev("response.created", response=skeleton)
        yield ev("response.in_progress", response=skeleton)
        async for text in ex.deltas():
            if text is None:
                yield ": keep-alive\n\n"
                continue
            if not opened:
                opened = True
                for line in open_message():
                    yield line
            sent += text
            yield delta(text)
        gen, parsed = await ex.finish()
        state, rest = status(gen, parsed), tail(gen, parsed, sent)
        output: list[dict[str, Any]] = []
        if not opened and (rest or not parsed.tool_calls):  # a message item always, unless only tool calls
            opened = True
            for line in open_message():
                yield line
        if rest:
            sent += rest
            yield delta(rest)
        if opened:
            item = message_item(mid, sent, state)
            at = {"item_id": mid, "output_index": 0, "content_index": 0}
            yield ev("response.output_text.done", **at, text=sent, logprobs=[])
            yield ev("response.content_part.done", **at, part=item["content"][0])
            yield ev("response.output_item.done", output_index=0, item=item)
            output.append(item)
        for item in function_call_items(rid, parsed, len(output)):
            index = len(output)
            yield ev("response.output_item.added", output_index=index,
                     item={**item, "arguments": "", "status": "in_progress"})
            yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                     delta=item["arguments"])
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     name=item["name"], arguments=item["arguments"])
            yield ev("response.output_item.done", output_index=index, item=item)
            output.append(item)
        used = usage(len(gen.prompt_ids), len(gen.token_ids))
        final = response_object(rid, req, created_at, state, output, used)
        yield ev("response.completed" if state == "completed" else "response.incomplete", response=final)

    def stream_error(self, ex: Exchange, exc: APIError | EngineError) -> str:
        ev = ex.state if isinstance(ex.state, Events) else Events()
        error = {"code": "server_error" if exc.status >= 500 else exc.code or "invalid_request", "message": exc.message}
        return ev("response.failed", response=response_object(ex.job.reply_id, ex.job.req, ex.job.created,
                                                                    "failed", [], None, error))


RESPONSES = Responses()


@router.post("/v1/responses", openapi_extra=schema.request_body(ResponsesRequest))
async def responses(request: Request) -> Any:
    return await handle(request, RESPONSES, None)


@router.post("/{session_id}/{prompt_id}/v1/responses", openapi_extra=schema.request_body(ResponsesRequest))
async def responses_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, RESPONSES, (session_id, prompt_id))


@router.post("/{session_id}/{prompt_id}/responses", openapi_extra=schema.request_body(ResponsesRequest))
async def responses_with_ids_bare(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, RESPONSES, (session_id, prompt_id), bare=True)
