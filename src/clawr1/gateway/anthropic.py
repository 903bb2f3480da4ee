"""`POST /v1/messages` (and `/{session}/{prompt}/v1/messages`): the Anthropic Messages API, plain
and SSE, on chat's capture path (`translated.py`); the format itself is in `anthropic_wire.py`.

Point an Anthropic client at `http://127.0.0.1:8000` (or `.../{session_id}/{prompt_id}`). The key
may come as `x-api-key` (what the SDKs send) or `Authorization: Bearer`. Every error is answered in
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, since Anthropic clients read
nothing else; the app's handlers would answer OpenAI's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from clawr1.core.types import EngineError
from clawr1.gateway import anthropic_wire as wire
from clawr1.gateway.app import Gateway, new_id
from clawr1.gateway.errors import APIError
from clawr1.gateway.streaming import TimedOut
from clawr1.gateway.translated import Call, now, tail

log = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    return await _answer(request, None)


@router.post("/{session_id}/{prompt_id}/v1/messages")
async def messages_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await _answer(request, (session_id, prompt_id))


async def _answer(request: Request, path_ids: tuple[str, str] | None) -> Any:
    try:
        return await create_message(request.app.state.gateway, request, path_ids)
    except (APIError, EngineError) as exc:
        return JSONResponse(wire.error_body(exc.status, exc.message, exc.code), status_code=exc.status)
    except Exception as exc:  # what the app's last-resort handler does, in Anthropic's shape
        log.exception("unhandled error in /v1/messages")
        return JSONResponse(wire.error_body(500, f"internal error ({type(exc).__name__}); see the server log"),
                            status_code=500)


def api_key(request: Request) -> str:
    """`x-api-key` first (the Anthropic SDKs' header), else the Bearer token."""
    auth = request.headers.get("authorization", "")
    return request.headers.get("x-api-key", "").strip() or (auth[7:].strip() if auth.startswith("Bearer ") else "")


async def create_message(gw: Gateway, request: Request, path_ids: tuple[str, str] | None) -> Any:
    started, _ = now()
    caller = gw.authorize(api_key(request))
    req = await gw.read(request, wire.MessagesRequest)
    chat, tools, sampling = req.chat_messages(), req.chat_tools(), req.sampling()
    mid = new_id("msg_")
    call = Call.begin(gw, request, caller, chat, tools, sampling, path_ids, mid, started)
    if req.stream:
        return StreamingResponse(stream_message(call, req.model, mid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    done = await call.result(request)
    if done is None:
        return Response(status_code=499)  # nobody is listening; the step is stored as aborted
    return JSONResponse(wire.message_body(mid, req.model, *done))


async def stream_message(call: Call, model: str, mid: str) -> AsyncIterator[str]:
    """message_start, ping, the text block's deltas as sampled (tool-call markup held back), then
    one block per tool call (its input as a single `input_json_delta`), message_delta, message_stop.
    A keep-alive tick is a `ping`."""
    opened = False  # the text block (index 0) has started
    sent = ""
    try:
        yield wire.event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": wire.usage(call.prompt_tokens, 0)}})
        yield wire.event("ping", {})
        try:
            async for delta in call.deltas():
                if delta is None:
                    yield wire.event("ping", {})
                    continue
                if not opened:
                    opened = True
                    yield wire.event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                sent += delta
                yield wire.event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta}})
        except TimedOut:
            yield wire.event("error", wire.error_body(504, f"the engine did not finish within "
                                                 f"{call.gw.config.gateway.request_timeout_s} s"))
            return
        gen, parsed = await call.finished()
        rest = tail(gen, parsed, sent)
        if not opened and (rest or not parsed.tool_calls):  # a text block always, unless only tool calls
            opened = True
            yield wire.event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        if rest:
            yield wire.event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": rest}})
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
    finally:
        call.settle()
