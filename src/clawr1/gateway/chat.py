"""`POST /v1/chat/completions` (and `/{session}/{prompt}/v1/chat/completions`): plain and SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from clawr1.engine.base import GenerationStream
from clawr1.gateway import schema
from clawr1.gateway.app import Gateway, new_id
from clawr1.gateway.errors import APIError
from clawr1.gateway.sessions import Turn, affinity_key
from clawr1.gateway.streaming import TimedOut, events, sse, timeout_event

router = APIRouter()
TOOL_OPEN = "<tool_call>"


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Any:
    return await chat_completions(request.app.state.gateway, request, None)


@router.post("/{session_id}/{prompt_id}/v1/chat/completions")
async def chat_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await chat_completions(request.app.state.gateway, request, (session_id, prompt_id))


async def chat_completions(gw: Gateway, request: Request, path_ids: tuple[str, str] | None) -> Any:
    started = time.perf_counter()
    caller = gw.authenticate(request)
    req = await gw.read(request, schema.ChatRequest)
    if req.stream and req.n > 1:
        raise APIError(400, "n > 1 is not supported with stream=true", param="n")
    tools = req.tool_dicts()
    prompt_ids = gw.engine.render(req.messages, tools)
    samplings = [req.sampling(gw.config.engine.default_max_tokens, i) for i in range(req.n)]
    headers = {k.lower(): v for k, v in request.headers.items()}
    streams = gw.start(prompt_ids, samplings, caller.tenant,
                       affinity_key(caller.tenant, req.messages, headers, path_ids))
    turn = gw.sessions.resolve(caller.tenant, req.messages, headers, path_ids, caller.session_id)
    cid = new_id("chatcmpl-")
    if req.stream:
        return StreamingResponse(stream_chat(gw, req, streams[0], turn, cid, started),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        gens, outcome = await gw.collect(request, streams)
        for i, gen in enumerate(gens):
            gw.record(turn, req.messages, tools, gen, f"{cid}-{i}", started)
    finally:
        gw.pending -= len(streams)
    gw.turn_done(turn)
    if outcome == "disconnected":
        return Response(status_code=499)  # nobody is listening; the steps are stored as aborted
    if outcome == "timeout":
        raise APIError(504, f"the engine did not finish within {gw.config.gateway.request_timeout_s} s",
                       code="timeout")
    parsed = [gw.engine.parse(g.content) for g in gens]
    gw.sessions.record(turn, req.messages, schema.message_of(parsed[0]))
    return JSONResponse(schema.completion_body(cid, req.model, gens, parsed, req.logprobs, gw.engine.tokenizer))


async def stream_chat(gw: Gateway, req: schema.ChatRequest, stream: GenerationStream, turn: Turn, cid: str,
                      started: float) -> AsyncIterator[str]:
    """SSE: role chunk, content deltas (tool-call markup held back), tool calls, finish, usage."""
    version, model = stream.version, req.model
    sent = visible = ""  # content already streamed / sampled so far
    logprobs: list[dict[str, Any]] = []  # entries not yet sent (their text may be held back)
    watch_tools = req.tool_dicts() is not None
    try:
        yield sse(schema.chunk(cid, model, version, {"role": "assistant", "content": ""}))
        try:
            async for event in events(stream, gw.config.gateway.keepalive_s, gw.config.gateway.request_timeout_s):
                if event is None:  # queued behind other requests: an empty delta resets client idle timers
                    yield sse(schema.chunk(cid, model, version, {}))
                    continue
                visible += event.text
                if req.logprobs:
                    logprobs.append(schema.token_logprob(gw.engine.tokenizer.decode([event.token_id]), event.logprob))
                delta = safe_text(visible, sent, watch_tools)
                if delta:
                    sent += delta
                    lp, logprobs = ({"content": logprobs} if logprobs else None), []
                    yield sse(schema.chunk(cid, model, version, {"content": delta}, logprobs=lp))
        except TimedOut:
            yield timeout_event(gw.config.gateway.request_timeout_s)
            return
        gen = await stream.final()  # the stream is drained: returns at once (the Engine contract)
        parsed = gw.engine.parse(gen.content)
        if parsed.tool_calls:
            calls = schema.message_of(parsed)["tool_calls"]
            yield sse(schema.chunk(cid, model, version, {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
        elif len(gen.content) > len(sent):
            yield sse(schema.chunk(cid, model, version, {"content": gen.content[len(sent):]}))
        yield sse(schema.chunk(cid, model, version, {}, finish=schema.finish_reason(gen, parsed),
                               logprobs={"content": logprobs} if logprobs else None))
        if req.stream_options and req.stream_options.include_usage:
            body = schema.chunk(cid, model, version, {})
            body["choices"], body["usage"] = [], schema.usage(len(gen.prompt_ids), len(gen.token_ids))
            yield sse(body)
        # Before [DONE]: the client may send its next turn the moment it sees it.
        gw.sessions.record(turn, req.messages, schema.message_of(parsed))
        yield "data: [DONE]\n\n"
    finally:
        # Normal end, client disconnect (the generator is closed), timeout or error: stop the
        # engine and record what was sampled; an interrupted step is stored as `aborted`.
        stream.cancel()
        gw.spawn(gw.settle_stream(turn, req.messages, req.tool_dicts(), stream, f"{cid}-0", started))


def safe_text(visible: str, sent: str, watch_tools: bool) -> str:
    """New content that is safe to stream: with tools on, nothing from a `<tool_call>` on (and no
    suffix that could start one), since it may turn into a structured tool call at the end."""
    end = len(visible)
    if watch_tools:
        at = visible.find(TOOL_OPEN)
        if at >= 0:
            end = at
        else:
            for n in range(min(len(TOOL_OPEN) - 1, end), 0, -1):
                if visible.endswith(TOOL_OPEN[:n]):
                    end -= n
                    break
    return visible[len(sent):end] if end > len(sent) else ""
