"""`POST /v1/completions` (and `/{session}/{prompt}/v1/completions`): raw prompts as text or token
ids, for white-box agents that run their own template; the same pipeline and recording as chat.
Each prompt's choices are one turn of the session; `prompt_id` groups them (GRPO groups)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request

from clawr1.core.types import EngineError, Generation, ParsedCompletion
from clawr1.gateway import schema
from clawr1.gateway.errors import APIError
from clawr1.gateway.ids import new_id
from clawr1.gateway.pipeline import Exchange, Job, Wire, handle
from clawr1.gateway.service import Caller, Gateway
from clawr1.gateway.streaming import spliced, sse

router = APIRouter()


def _body(ex: Exchange, version: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """`created` is the request's (`Job.created`): the same in every chunk of a stream."""
    return {"id": ex.job.reply_id, "object": "text_completion", "created": ex.job.created, "model": ex.job.req.model,
            "system_fingerprint": schema.fingerprint(version), "choices": choices}


def _text_chunk(ex: Exchange, version: int) -> Callable[[str], str]:
    """The chunk of nearly every token, rendered once with the text spliced in (as chat's)."""
    return spliced(lambda delta: sse(_body(ex, version, [{"index": 0, "text": delta, "logprobs": None,
                                                          "finish_reason": None}])))


class Completions(Wire):
    request_model = schema.CompletionRequest

    def prepare(self, gw: Gateway, req: schema.CompletionRequest, caller: Caller, headers: dict[str, str],
                path_ids: tuple[str, str] | None) -> Job:
        tokenizer = gw.engine.tokenizer
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts()]
        if req.stream and (len(prompts) > 1 or req.n > 1):
            raise APIError(400, "stream=true takes one prompt and n = 1", param="prompt" if len(prompts) > 1 else "n")
        vocab = len(tokenizer)
        for i, ids in enumerate(prompts):
            if any(t >= vocab for t in ids):
                raise APIError(400, f"prompt {i}: token ids must be in [0, {vocab})", param="prompt")
        return Job(req, new_id("cmpl-"), prompts, [req.sampling(gw.sampling_defaults, i) for i in range(req.n)], stream=req.stream)

    def body(self, ex: Exchange, gens: list[Generation], parsed: list[ParsedCompletion]) -> dict[str, Any]:
        req, tokenizer = ex.job.req, ex.gw.engine.tokenizer
        choices = [schema.text_choice(i, g, req, tokenizer, g.content, schema.text_finish(g)) for i, g in enumerate(gens)]
        body = _body(ex, gens[0].version, choices)
        body["usage"] = schema.usage(sum(len(g.prompt_ids) for g in gens[::req.n]), sum(len(g.token_ids) for g in gens))
        return body

    async def events(self, ex: Exchange) -> AsyncIterator[str]:
        req, version = ex.job.req, ex.streams[0].version
        text = _text_chunk(ex, version)
        sent = visible = ""
        async for event in ex.tokens():
            if event is not None:
                if not visible and version != ex.streams[0].version:  # swapped in while it queued (as chat's)
                    version = ex.streams[0].version
                    text = _text_chunk(ex, version)
                visible += event.text
            delta = visible[len(sent):]
            if event is None or delta:  # a keep-alive is an empty text chunk
                sent = visible
                yield text(delta)
        gen, _ = await ex.finish()
        # Text after a stop sequence was never streamed (the engine holds stop prefixes back).
        tail = gen.content[len(sent):] if len(gen.content) > len(sent) else ""
        yield sse(_body(ex, version, [schema.text_choice(0, gen, req, ex.gw.engine.tokenizer, tail,
                                                         schema.text_finish(gen))]))
        if req.stream_options and req.stream_options.include_usage:
            body = _body(ex, version, [])
            body["usage"] = schema.usage(len(gen.prompt_ids), len(gen.token_ids))
            yield sse(body)
        yield "data: [DONE]\n\n"

    def stream_error(self, ex: Exchange, exc: APIError | EngineError) -> str:
        return sse(self.error_body(exc))


COMPLETIONS = Completions()


@router.post("/v1/completions", openapi_extra=schema.request_body(schema.CompletionRequest))
async def completions(request: Request) -> Any:
    return await handle(request, COMPLETIONS, None)


@router.post("/{session_id}/{prompt_id}/v1/completions", openapi_extra=schema.request_body(schema.CompletionRequest))
async def completions_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, COMPLETIONS, (session_id, prompt_id))


@router.post("/{session_id}/{prompt_id}/completions", openapi_extra=schema.request_body(schema.CompletionRequest))
async def completions_with_ids_bare(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, COMPLETIONS, (session_id, prompt_id), bare=True)
