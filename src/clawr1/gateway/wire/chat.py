"""`POST /v1/chat/completions` (and `/{session}/{prompt}/v1/chat/completions`): plain and SSE. The
wire format only: parsing into a `Job`, the reply body, the chunks; the rest is `pipeline.py`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from clawr1.core.types import EngineError, Generation, ParsedCompletion
from clawr1.gateway import schema
from clawr1.gateway.errors import APIError
from clawr1.gateway.ids import new_id
from clawr1.gateway.memory import rendered
from clawr1.gateway.pipeline import Exchange, Job, Wire, handle
from clawr1.gateway.service import Caller, Gateway
from clawr1.gateway.sessions import affinity_key
from clawr1.gateway.stream_text import safe_text, tail
from clawr1.gateway.streaming import spliced, sse

router = APIRouter()


class Chunks:
    """One stream's chunks. They share `created`, the request's (`Job.created`; OpenAI: "each chunk
    has the same timestamp"), and the chunk of nearly every token, a bare content delta, is the
    envelope rendered once with the delta's JSON string spliced in: 0.3 us a token instead of 4.7
    for building and dumping the whole chunk."""

    def __init__(self, cid: str, model: str, version: int, created: int):
        self.cid, self.model, self.version, self.created = cid, model, version, created
        self.content = spliced(lambda text: self.event({"content": text}))
        """`event({"content": text})`, without building the chunk."""

    def body(self, delta: dict[str, Any], finish: str | None = None,
             logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return schema.chunk(self.cid, self.model, self.version, self.created, delta, finish, logprobs)

    def event(self, delta: dict[str, Any], finish: str | None = None, logprobs: dict[str, Any] | None = None) -> str:
        return sse(self.body(delta, finish, logprobs))


class Chat(Wire):
    request_model = schema.ChatRequest

    def messages(self, req: schema.ChatRequest) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_unset=True) for m in req.messages]

    def prepare(self, gw: Gateway, req: schema.ChatRequest, caller: Caller, headers: dict[str, str],
                path_ids: tuple[str, str] | None) -> Job:
        if req.stream and req.n > 1:
            raise APIError(400, "n > 1 is not supported with stream=true", param="n")
        messages = self.messages(req)
        tools = req.tool_dicts()
        prompt, recall = rendered(gw, caller, headers, path_ids, req, messages, tools)  # the user's memory added
        samplings = [req.sampling(gw.config.engine.default_max_tokens, gw.sampling_defaults, i) for i in range(req.n)]
        return Job(req, new_id("chatcmpl-"), [prompt], samplings, messages, tools, req.stream,
                   watch_tools=tools is not None, affinity=affinity_key(caller.tenant, messages, headers, path_ids, caller.session_id),
                   recall=recall)

    def body(self, ex: Exchange, gens: list[Generation], parsed: list[ParsedCompletion]) -> dict[str, Any]:
        req = ex.job.req
        return schema.completion_body(ex.job.reply_id, req.model, gens, parsed, req.logprobs, ex.gw.engine.tokenizer)

    async def events(self, ex: Exchange) -> AsyncIterator[str]:
        """Role chunk, content deltas (tool-call markup held back), tool calls, finish, usage."""
        req = ex.job.req
        chunks = Chunks(ex.job.reply_id, req.model, ex.streams[0].version, ex.job.created)
        tokenizer = ex.gw.engine.tokenizer
        sent = visible = ""  # content already streamed / sampled so far
        logprobs: list[dict[str, Any]] = []  # entries not yet sent (their text may be held back)
        yield chunks.event({"role": "assistant", "content": ""})
        async for event in ex.tokens():
            if event is None:  # queued behind other requests: an empty delta resets client idle timers
                yield chunks.event({})
                continue
            if not visible and chunks.version != ex.streams[0].version:
                # Sampling began on weights swapped in while the request queued: the chunks from
                # here on name the version that samples it (the one its step records; settled
                # once sampling began, so only checked before the first text).
                chunks = Chunks(ex.job.reply_id, req.model, ex.streams[0].version, ex.job.created)
            visible += event.text
            if req.logprobs:
                logprobs.append(schema.token_logprob(tokenizer.decode([event.token_id]), event.logprob))
            # Without tools nothing is held back: the token's text is the delta (`safe_text`'s answer).
            delta = safe_text(visible, sent, True) if ex.job.watch_tools else event.text
            if delta:
                sent += delta
                if logprobs:
                    yield chunks.event({"content": delta}, logprobs={"content": logprobs})
                    logprobs = []
                else:
                    yield chunks.content(delta)
        gen, parsed = await ex.finish()  # recorded (committed with durable_reply) before the last chunks
        rest = tail(gen, parsed, sent)
        if rest:
            yield chunks.content(rest)
        if parsed.tool_calls:
            calls = schema.message_of(parsed)["tool_calls"]
            yield chunks.event({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        yield chunks.event({}, finish=schema.finish_reason(gen, parsed),
                           logprobs={"content": logprobs} if logprobs else None)
        if req.stream_options and req.stream_options.include_usage:
            body = chunks.body({})
            body["choices"], body["usage"] = [], schema.usage(len(gen.prompt_ids), len(gen.token_ids))
            yield sse(body)
        yield "data: [DONE]\n\n"

    def stream_error(self, ex: Exchange, exc: APIError | EngineError) -> str:
        """OpenAI ends a failed stream with an error object as the last data event."""
        return sse(self.error_body(exc))


CHAT = Chat()


@router.post("/v1/chat/completions", openapi_extra=schema.request_body(schema.ChatRequest))
async def chat(request: Request) -> Any:
    return await handle(request, CHAT, None)


@router.post("/{session_id}/{prompt_id}/v1/chat/completions", openapi_extra=schema.request_body(schema.ChatRequest))
async def chat_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, CHAT, (session_id, prompt_id))


# Without /v1 too: Claw-R1 documents base_url = http://gateway:8000/{traj_uid}/{prompt_uid}, to
# which the OpenAI client appends /chat/completions.
@router.post("/{session_id}/{prompt_id}/chat/completions", openapi_extra=schema.request_body(schema.ChatRequest))
async def chat_with_ids_bare(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, CHAT, (session_id, prompt_id), bare=True)
