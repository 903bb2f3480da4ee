"""`POST /v1/messages` (and `/{session}/{prompt}/v1/messages`): the Anthropic Messages API, plain
and SSE, on chat's capture path (`pipeline.py`, `translated.py`); the format itself is in
`anthropic_wire.py`.

Point an Anthropic client at `http://127.0.0.1:8000` (or `.../{session_id}/{prompt_id}`). The key
may come as `x-api-key` (what the SDKs send) or `Authorization: Bearer`. Every error is answered in
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, since Anthropic clients read
nothing else.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from clawr1.core.types import EngineError, Generation, ParsedCompletion
from clawr1.gateway import anthropic_wire as wire
from clawr1.gateway import schema
from clawr1.gateway.errors import APIError, anthropic_error_body
from clawr1.gateway.ids import new_id
from clawr1.gateway.pipeline import Exchange, Job, Wire, handle, tail
from clawr1.gateway.service import Caller, Gateway
from clawr1.gateway.translated import chat_job

router = APIRouter()


class Messages(Wire):
    request_model = wire.MessagesRequest

    def token(self, request: Request) -> str:
        """`x-api-key` first (the Anthropic SDKs' header), else the Bearer token."""
        return request.headers.get("x-api-key", "").strip() or super().token(request)

    def prepare(self, gw: Gateway, req: wire.MessagesRequest, caller: Caller, headers: dict[str, str],
                path_ids: tuple[str, str] | None) -> Job:
        return chat_job(gw, req, caller, new_id("msg_"), self.messages(req), req.chat_tools(), req.sampling(gw.sampling_defaults),
                        headers, path_ids)

    def error_body(self, exc: APIError | EngineError) -> dict[str, Any]:
        return anthropic_error_body(exc.status, exc.message, exc.code)

    def body(self, ex: Exchange, gens: list[Generation], parsed: list[ParsedCompletion]) -> dict[str, Any]:
        return wire.message_body(ex.job.reply_id, ex.job.req.model, gens[0], parsed[0])

    async def events(self, ex: Exchange) -> AsyncIterator[str]:
        """message_start, ping, the text block's deltas as sampled (tool-call markup held back), then
        one block per tool call (its input as a single `input_json_delta`), message_delta,
        message_stop. A keep-alive tick is a `ping`."""
        opened = False  # the text block (index 0) has started
        sent = ""
        yield wire.event("message_start", {"message": {
            "id": ex.job.reply_id, "type": "message", "role": "assistant", "model": ex.job.req.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": wire.usage(len(ex.job.prompts[0]), 0)}})
        yield wire.event("ping", {})
        async for delta in ex.deltas():
            if delta is None:
                yield wire.event("ping", {})
                continue
            if not opened:
                opened = True
                yield wire.event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            sent += delta
            yield wire.text_delta(delta)
        gen, parsed = await ex.finish()
        rest = tail(gen, parsed, sent)
        if not opened and (rest or not parsed.tool_calls):  # a text block always, unless only tool calls
            opened = True
            yield wire.event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        if rest:
            yield wire.text_delta(rest)
        if opened:
            yield wire.event("content_block_stop", {"index": 0})
        for index, tool_call in enumerate(parsed.tool_calls, start=int(opened)):
            block = wire.tool_use(tool_call)
            yield wire.event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            yield wire.event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
            yield wire.event("content_block_stop", {"index": index})
        yield wire.event("message_delta", {"delta": {"stop_reason": wire.stop_reason(gen, parsed),
                                                     "stop_sequence": wire.stop_sequence(gen, parsed)},
                                           "usage": {"output_tokens": len(gen.token_ids)}})
        yield wire.event("message_stop", {})

    def stream_error(self, ex: Exchange, exc: APIError | EngineError) -> str:
        return wire.event("error", self.error_body(exc))


MESSAGES = Messages()


@router.post("/v1/messages", openapi_extra=schema.request_body(wire.MessagesRequest))
async def messages(request: Request) -> Any:
    return await handle(request, MESSAGES, None)


@router.post("/{session_id}/{prompt_id}/v1/messages", openapi_extra=schema.request_body(wire.MessagesRequest))
async def messages_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, MESSAGES, (session_id, prompt_id))
