"""`POST /v1/quality`: how sane are replies the gateway already served, judged against the base
model's own replies to the same prompts.

A client that measures learning (the demo, `clawr1 eval`, a dashboard) names chat completions by
their `id` and gets each reply's relevance, base-model fluency, repetition and drift, and whether
it is *sane*: within the normal range of the reference replies (`clawr1.quality`). The references
are the base's replies to the same prompts (side turns with `X-Policy-Version: 0`), so "normal"
means "what this base model says to these requests", not a number fixed for every model.

Everything is read from the pool, never from the request: the exact token ids, prompt ids and
behaviour logprobs the engine recorded, so the KL is measured on what was served. A tenant sees
only its own completions (another tenant's id is unknown: 404, nothing leaks), and a per-session
key only its session's.

The base model's scorings run inside the gateway's admission, as generations do: the request holds
a ticket for as many scorings as it runs at once (the meter's concurrency, at most the tenant's
share), so one request naming 1,024 replies cannot crowd out other tenants' requests.

A calibration costs one base scoring pass per reference; the same reference set asked about again
(a client measuring served replies in batches) reuses it (`CALIBRATIONS` most recent sets).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from clawr1.core.records import Step
from clawr1.datapool.base import UnknownStepError
from clawr1.gateway.errors import APIError
from clawr1.gateway.schema import request_body
from clawr1.gateway.service import Caller, Gateway
from clawr1.quality import Calibration, Quality, Reply, insane_because, summarize
from clawr1.quality.calibration import MIN_REPLIES
from clawr1.quality.measures import measured_text

router = APIRouter()

MAX_IDS = 512
CALIBRATIONS = 8
COMMIT_WAIT_S = 2.0
"""How long an id not in the pool is waited for before the 404: a step is committed just after its
reply went out, and a client may ask about it at once (the pool's queue cannot tell: a batch the
writer took is neither queued nor committed)."""

CompletionId = Annotated[str, Field(min_length=1, max_length=256)]


class QualityRequest(BaseModel):
    """Replies to measure, and the base model's replies to the same prompts to judge them by."""

    model_config = ConfigDict(extra="forbid")
    completion_ids: list[CompletionId] = Field(min_length=1, max_length=MAX_IDS)
    """`id`s of recorded chat completions (their first choice is measured)."""
    reference_ids: list[CompletionId] = Field(min_length=1, max_length=MAX_IDS)
    """`id`s of the base model's replies to the same prompts (side turns with `X-Policy-Version: 0`;
    at least 8): their range is "sane"."""


@router.post("/v1/quality", openapi_extra=request_body(QualityRequest))
async def quality(request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    caller = await gw.authenticate(request)
    body = await gw.read(request, QualityRequest)
    if len(set(body.reference_ids)) < MIN_REPLIES:
        raise APIError(400, f"reference_ids: a calibration needs at least {MIN_REPLIES} distinct base replies, "
                            f"got {len(set(body.reference_ids))}", param="reference_ids", code="too_few_references")
    if gw.full:
        raise APIError(400, "reply quality compares with the base model, which a gateway serving fully fine-tuned "
                            "weights no longer has", code="unsupported")
    references = sorted(set(body.reference_ids))
    steps = await _steps(gw, caller, list(dict.fromkeys(body.completion_ids + references)))
    meter = await gw.quality_meter()
    at_once = min(len(steps), meter.concurrency, gw.admission.most)
    ticket = gw.admission.acquire(at_once, caller.tenant)  # 429 when the gateway or the tenant is full
    try:
        calibration, known = await _calibration(request, gw, caller, meter, [steps[i] for i in references], at_once)
        # A reference asked about again (the base's replies, measured against themselves) was just
        # measured for its calibration: each of those scores is a forward pass over its whole prompt.
        todo = [i for i in dict.fromkeys(body.completion_ids) if steps[i].step_id not in known]
        found = known | dict(zip((steps[i].step_id for i in todo),
                                 await meter.measure([_reply(gw, steps[i]) for i in todo], at_once)))
        measured = [found[steps[i].step_id] for i in body.completion_ids]
    finally:
        ticket.release()
    data = []
    for completion_id, q in zip(body.completion_ids, measured):
        why = insane_because(q, calibration)
        data.append({"completion_id": completion_id, "policy_version": steps[completion_id].policy_version,
                     "relevance": q.relevance, "fluency": q.fluency, "repetition": q.repetition, "kl": q.kl,
                     "entropy": q.entropy, "n_tokens": q.n_tokens, "tool_call": q.tool_call, "sane": not why,
                     "reasons": why})
    return {"object": "quality", "data": data, "calibration": calibration.to_dict(),
            "summary": summarize(measured, calibration).to_dict()}


async def _steps(gw: Gateway, caller: Caller, ids: list[str]) -> dict[str, Step]:
    """completion id -> its first choice's step, the caller's own only; 404 names an unknown id."""
    deadline = time.monotonic() + COMMIT_WAIT_S
    while True:
        try:
            found = await asyncio.to_thread(gw.pool.get_steps, [f"{i}-0" for i in ids])
            break
        except UnknownStepError as exc:
            if time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the step may not be handed to the pool, or not committed, yet
                continue
            missing = exc.args[0].split(", ")[0].removesuffix("-0")
            raise APIError(404, f"no recorded chat completion {missing!r} (steps are stored right after each reply)",
                           param="completion_ids", code="completion_not_found") from exc
    for completion_id, step in zip(ids, found):
        mine = step.tenant == caller.tenant and caller.session_id in (None, step.session_id)
        if not mine:  # the same answer as for an id that does not exist: nothing about others leaks
            raise APIError(404, f"no recorded chat completion {completion_id!r} (steps are stored right after "
                                "each reply)", param="completion_ids", code="completion_not_found")
    return dict(zip(ids, found))


def _reply(gw: Gateway, step: Step) -> Reply:
    """A recorded step as the meter measures it: the reply's text as the client got it, the exact
    sampled ids and their behaviour logprobs. A reply that is only a tool call has no content: the
    call as the model wrote it is what is measured (an agent's last turn may be one), as a call."""
    text, call = measured_text(gw.engine.parse, step.text, step.tools)
    return Reply(step.messages, text, step.token_ids, step.prompt_ids, step.logprobs, step.temperature,
                 step.top_k, step.top_p, tool_call=call)


async def _calibration(request: Request, gw: Gateway, caller: Caller, meter: Any, steps: list[Step],
                       concurrency: int) -> tuple[Calibration, dict[str, Quality]]:
    """The references' normal range and each reference's measures (step id -> `Quality`), from the
    cache when the same set was asked about before."""
    cache: OrderedDict[tuple[str, tuple[str, ...]], tuple[Calibration, dict[str, Quality]]] = _cache(request)
    key = (caller.tenant, tuple(s.step_id for s in steps))
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    replies = [_reply(gw, s) for s in steps]
    try:
        calibration, measured = await meter.calibrate(replies, concurrency)
    except ValueError as exc:  # fewer non-empty references than a range needs
        raise APIError(400, f"reference_ids: {exc}", param="reference_ids", code="too_few_references") from exc
    known = {s.step_id: q for s, q in zip(steps, measured)}
    cache[key] = (calibration, known)
    while len(cache) > CALIBRATIONS:
        cache.popitem(last=False)
    return calibration, known


def _cache(request: Request) -> OrderedDict[tuple[str, tuple[str, ...]], tuple[Calibration, dict[str, Quality]]]:
    """This app's calibration cache (one per gateway; it lives as long as the app)."""
    state = request.app.state
    if getattr(state, "quality_calibrations", None) is None:
        state.quality_calibrations = OrderedDict()
    return state.quality_calibrations
