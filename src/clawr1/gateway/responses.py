"""`POST /v1/responses` (and `/{session}/{prompt}/v1/responses`): the OpenAI Responses API, plain
and SSE, on chat's capture path (`translated.py`); the format itself is in `responses_wire.py`.
Errors are OpenAI-shaped, as for chat. Stateless: see `responses_wire.py` for what is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from clawr1.gateway import responses_wire as wire
from clawr1.gateway.app import Gateway, new_id
from clawr1.gateway.streaming import TimedOut
from clawr1.gateway.translated import Call, now, tail

router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request) -> Any:
    return await create_response(request.app.state.gateway, request, None)


@router.post("/{session_id}/{prompt_id}/v1/responses")
async def responses_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await create_response(request.app.state.gateway, request, (session_id, prompt_id))


async def create_response(gw: Gateway, request: Request, path_ids: tuple[str, str] | None) -> Any:
    started, created_at = now()
    caller = gw.authenticate(request)
    req = await gw.read(request, wire.ResponsesRequest)
    req.refuse_state()
    messages, tools = req.chat_messages(), req.chat_tools()
    rid = new_id("resp_")
    call = Call.begin(gw, request, caller, messages, tools, req.sampling(gw.config.engine.default_max_tokens),
                      path_ids, rid, started)
    if req.stream:
        return StreamingResponse(stream_response(call, req, rid, created_at), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    done = await call.result(request)
    if done is None:
        return Response(status_code=499)  # nobody is listening; the step is stored as aborted
    gen, parsed = done
    output, used = wire.output_items(rid, gen, parsed), wire.usage(len(gen.prompt_ids), len(gen.token_ids))
    return JSONResponse(wire.response_object(rid, req, created_at, wire.status(gen, parsed), output, used))


async def stream_response(call: Call, req: wire.ResponsesRequest, rid: str, created_at: int) -> AsyncIterator[str]:
    """response.created / in_progress; the message item's text deltas as sampled (opened at the
    first one; tool-call markup held back); one function_call item per call; then
    response.completed (or response.incomplete when `max_output_tokens` cut it). A keep-alive tick
    is an SSE comment, which clients skip; a timeout ends the stream with response.failed."""
    ev = wire.Events()
    mid = wire.message_id(rid)
    opened = False  # the message item (output 0) has started
    sent = ""

    def open_message() -> list[str]:
        item = {**wire.message_item(mid, "", "in_progress"), "content": []}
        return [ev("response.output_item.added", output_index=0, item=item),
                ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def delta(text: str) -> str:
        return ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=text, logprobs=[])

    try:
        skeleton = wire.response_object(rid, req, created_at, "in_progress", [], None)
        yield ev("response.created", response=skeleton)
        yield ev("response.in_progress", response=skeleton)
        try:
            async for text in call.deltas():
                if text is None:
                    yield ": keep-alive\n\n"
                    continue
                if not opened:
                    opened = True
                    for line in open_message():
                        yield line
                sent += text
                yield delta(text)
        except TimedOut:
            error = {"code": "server_error",
                     "message": f"the engine did not finish within {call.gw.config.gateway.request_timeout_s} s"}
            yield ev("response.failed", response=wire.response_object(rid, req, created_at, "failed", [], None, error))
            return
        gen, parsed = await call.finished()
        state, rest = wire.status(gen, parsed), tail(gen, parsed, sent)
        output: list[dict[str, Any]] = []
        if not opened and (rest or not parsed.tool_calls):  # a message item always, unless only tool calls
            opened = True
            for line in open_message():
                yield line
        if rest:
            sent += rest
            yield delta(rest)
        if opened:
            item = wire.message_item(mid, sent, state)
            at = {"item_id": mid, "output_index": 0, "content_index": 0}
            yield ev("response.output_text.done", **at, text=sent, logprobs=[])
            yield ev("response.content_part.done", **at, part=item["content"][0])
            yield ev("response.output_item.done", output_index=0, item=item)
            output.append(item)
        for item in wire.function_call_items(rid, parsed, len(output)):
            index = len(output)
            yield ev("response.output_item.added", output_index=index,
                     item={**item, "arguments": "", "status": "in_progress"})
            yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                     delta=item["arguments"])
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     name=item["name"], arguments=item["arguments"])
            yield ev("response.output_item.done", output_index=index, item=item)
            output.append(item)
        used = wire.usage(len(gen.prompt_ids), len(gen.token_ids))
        final = wire.response_object(rid, req, created_at, state, output, used)
        yield ev("response.completed" if state == "completed" else "response.incomplete", response=final)
    finally:
        call.settle()
