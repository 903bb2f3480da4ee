"""`POST /v1/completions` (and `/{session}/{prompt}/v1/completions`): raw prompts as text or token
ids, for white-box agents that run their own template; the same recording as chat. Each prompt's
choices are one turn of the session; `prompt_id` groups them (GRPO groups)."""

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
from clawr1.gateway.sessions import Turn
from clawr1.gateway.streaming import TimedOut, events, sse, timeout_event

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    return await text_completions(request.app.state.gateway, request, None)


@router.post("/{session_id}/{prompt_id}/v1/completions")
async def completions_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await text_completions(request.app.state.gateway, request, (session_id, prompt_id))


def _body(cid: str, req: schema.CompletionRequest, version: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "system_fingerprint": schema.fingerprint(version), "choices": choices}


async def text_completions(gw: Gateway, request: Request, path_ids: tuple[str, str] | None) -> Any:
    started = time.perf_counter()
    caller = gw.authenticate(request)
    req = await gw.read(request, schema.CompletionRequest)
    prompts = [gw.engine.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts()]
    if req.stream and (len(prompts) > 1 or req.n > 1):
        raise APIError(400, "stream=true takes one prompt and n = 1", param="prompt" if len(prompts) > 1 else "n")
    headers = {k.lower(): v for k, v in request.headers.items()}
    # Validate and submit everything before resolving turns, so a bad prompt stores nothing.
    groups: list[list[GenerationStream]] = []  # one group of n per prompt
    try:
        for ids in prompts:
            groups.append(gw.start(ids, [req.sampling(i) for i in range(req.n)], caller.tenant))
    except BaseException:
        for streams in groups:
            for s in streams:
                s.cancel()
            gw.pending -= len(streams)
        raise
    turns = [gw.sessions.resolve(caller.tenant, [], headers, path_ids, caller.session_id) for _ in prompts]
    cid = new_id("cmpl-")
    if req.stream:
        return StreamingResponse(stream_text(gw, req, groups[0][0], turns[0], cid, started),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    all_streams = [s for streams in groups for s in streams]
    try:
        gens, outcome = await gw.collect(request, all_streams)
        for p, turn in enumerate(turns):
            for i in range(req.n):
                gw.record(turn, [], None, gens[p * req.n + i], f"{cid}-{p * req.n + i}", started)
    finally:
        gw.pending -= len(all_streams)
    for turn in turns:
        gw.turn_done(turn)
    if outcome == "disconnected":
        return Response(status_code=499)
    if outcome == "timeout":
        raise APIError(504, f"the engine did not finish within {gw.config.gateway.request_timeout_s} s", code="timeout")
    choices = [schema.text_choice(i, g, req, gw.engine.tokenizer, g.content, schema.text_finish(g))
               for i, g in enumerate(gens)]
    body = _body(cid, req, gens[0].version, choices)
    body["usage"] = schema.usage(sum(len(g.prompt_ids) for g in gens[::req.n]), sum(len(g.token_ids) for g in gens))
    return JSONResponse(body)


async def stream_text(gw: Gateway, req: schema.CompletionRequest, stream: GenerationStream, turn: Turn, cid: str,
                      started: float) -> AsyncIterator[str]:
    version = stream.version
    sent = visible = ""
    try:
        try:
            async for event in events(stream, gw.config.gateway.keepalive_s, gw.config.gateway.request_timeout_s):
                if event is not None:
                    visible += event.text
                delta = visible[len(sent):]
                if event is None or delta:  # a keep-alive is an empty text chunk
                    sent = visible
                    yield sse(_body(cid, req, version, [{"index": 0, "text": delta, "logprobs": None,
                                                          "finish_reason": None}]))
        except TimedOut:
            yield timeout_event(gw.config.gateway.request_timeout_s)
            return
        gen = await stream.final()  # the stream is drained: returns at once (the Engine contract)
        # Text after a stop sequence was never streamed (the engine holds stop prefixes back).
        tail = gen.content[len(sent):] if len(gen.content) > len(sent) else ""
        yield sse(_body(cid, req, version, [schema.text_choice(0, gen, req, gw.engine.tokenizer, tail,
                                                               schema.text_finish(gen))]))
        if req.stream_options and req.stream_options.include_usage:
            body = _body(cid, req, version, [])
            body["usage"] = schema.usage(len(gen.prompt_ids), len(gen.token_ids))
            yield sse(body)
        yield "data: [DONE]\n\n"
    finally:
        stream.cancel()
        gw.spawn(gw.settle_stream(turn, [], None, stream, f"{cid}-0", started))
