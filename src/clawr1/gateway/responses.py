"""`POST /v1/responses` (and `/{session}/{prompt}/v1/responses`): the OpenAI Responses API, plain
and SSE, on chat's capture path (`pipeline.py`, `translated.py`); the format itself is in
`responses_wire.py`. Errors are OpenAI-shaped, as for chat; a stream that fails ends with
`response.failed`. Stateless: see `responses_wire.py` for what is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from clawr1.core.types import EngineError, Generation, ParsedCompletion
from clawr1.gateway import responses_wire as wire
from clawr1.gateway import schema
from clawr1.gateway.errors import APIError
from clawr1.gateway.ids import new_id
from clawr1.gateway.pipeline import Exchange, Job, Wire, handle, tail
from clawr1.gateway.service import Caller, Gateway
from clawr1.gateway.translated import chat_job

router = APIRouter()


class Responses(Wire):
    request_model = wire.ResponsesRequest

    def prepare(self, gw: Gateway, req: wire.ResponsesRequest, caller: Caller, headers: dict[str, str],
                path_ids: tuple[str, str] | None) -> Job:
        req.refuse_state()
        return chat_job(gw, req, caller, new_id("resp_"), self.messages(req), req.chat_tools(),
                        req.sampling(gw.config.engine.default_max_tokens, gw.sampling_defaults), headers, path_ids)

    def body(self, ex: Exchange, gens: list[Generation], parsed: list[ParsedCompletion]) -> dict[str, Any]:
        gen, rid = gens[0], ex.job.reply_id
        output, used = wire.output_items(rid, gen, parsed[0]), wire.usage(len(gen.prompt_ids), len(gen.token_ids))
        return wire.response_object(rid, ex.job.req, ex.job.created, wire.status(gen, parsed[0]), output, used)

    async def events(self, ex: Exchange) -> AsyncIterator[str]:
        """response.created / in_progress; the message item's text deltas as sampled (opened at the
        first one; tool-call markup held back); one function_call item per call; then
        response.completed (or response.incomplete when `max_output_tokens` cut it). A keep-alive
        tick is an SSE comment, which clients skip."""
        req, rid, created_at = ex.job.req, ex.job.reply_id, ex.job.created
        ev = ex.state = wire.Events()  # the error event continues its sequence numbers
        mid = wire.message_id(rid)
        opened = False  # the message item (output 0) has started
        sent = ""

        def open_message() -> list[str]:
            item = {**wire.message_item(mid, "", "in_progress"), "content": []}
            return [ev("response.output_item.added", output_index=0, item=item),
                    ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

        delta = ev.text_deltas(mid)
        skeleton = wire.response_object(rid, req, created_at, "in_progress", [], None)
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

    def stream_error(self, ex: Exchange, exc: APIError | EngineError) -> str:
        ev = ex.state if isinstance(ex.state, wire.Events) else wire.Events()
        error = {"code": "server_error" if exc.status >= 500 else exc.code or "invalid_request", "message": exc.message}
        return ev("response.failed", response=wire.response_object(ex.job.reply_id, ex.job.req, ex.job.created,
                                                                    "failed", [], None, error))


RESPONSES = Responses()


@router.post("/v1/responses", openapi_extra=schema.request_body(wire.ResponsesRequest))
async def responses(request: Request) -> Any:
    return await handle(request, RESPONSES, None)


@router.post("/{session_id}/{prompt_id}/v1/responses", openapi_extra=schema.request_body(wire.ResponsesRequest))
async def responses_with_ids(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, RESPONSES, (session_id, prompt_id))


@router.post("/{session_id}/{prompt_id}/responses", openapi_extra=schema.request_body(wire.ResponsesRequest))
async def responses_with_ids_bare(session_id: str, prompt_id: str, request: Request) -> Any:
    return await handle(request, RESPONSES, (session_id, prompt_id), bare=True)
