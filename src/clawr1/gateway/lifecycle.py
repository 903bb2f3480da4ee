"""Feedback and session lifecycle: `POST /v1/feedback`, `POST /v1/sessions/{id}/close`, and the
admin routes that hand out per-session keys (`POST /admin/sessions`) and list sessions."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from clawr1.core.config import TENANT_NAME
from clawr1.core.records import DEFAULT_TENANT
from clawr1.datapool.base import UnknownSessionError, UnknownStepError
from clawr1.gateway.errors import APIError
from clawr1.gateway.ids import new_id
from clawr1.gateway.schema import check_id, request_body
from clawr1.gateway.service import Caller, Gateway

router = APIRouter()


class FeedbackRequest(BaseModel):
    """Explicit feedback on a turn: a reward, a textual correction (kept as a hint), or both."""

    model_config = ConfigDict(extra="ignore")
    session_id: str | None = Field(None, min_length=1, max_length=256)
    turn_index: int | None = Field(None, ge=0, le=2**31)
    """The turn it is about; default: the session's latest main turn."""
    completion_id: str | None = Field(None, min_length=1, max_length=256)
    """Instead of session + turn: the `id` of a chat completion (all its choices)."""
    reward: float | None = Field(None, ge=-1, le=1)
    correction: str | None = Field(None, min_length=1, max_length=8000)

    @model_validator(mode="after")
    def _something(self) -> FeedbackRequest:
        if self.reward is None and not (self.correction and self.correction.strip()):
            raise ValueError("give a reward in [-1, 1], a correction, or both")
        if self.session_id is not None and self.completion_id is not None:
            raise ValueError("name a session_id or a completion_id, not both")
        return self


class CloseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    outcome_reward: float | None = Field(None, ge=-1, le=1)
    """The whole session's result; it rewards the last main turn (else that turn is masked)."""
    step_weight: float | None = Field(None, ge=0, le=1)
    """With an outcome: earlier judged turns train with (1 - w) * judge + w * outcome; default
    `reward.step_weight`."""


class AgentSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:-]+$")
    """Its id (default: a new one)."""


class NewSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:-]+$")
    tenant: str = Field(DEFAULT_TENANT, pattern=TENANT_NAME)
    """The tenant the session (and its key) belongs to."""


def _own(caller: Caller, session_id: str) -> None:
    """A per-session key speaks only for its own session."""
    if caller.session_id is not None and caller.session_id != session_id:
        raise APIError(403, "this session key belongs to another session", code="permission_denied")


def _rates(caller: Caller) -> None:
    """An agent's session key serves its session; rating it (feedback, the close that decides its
    last turn) is for whoever holds the tenant's key (the black-box runner, with the task's outcome)."""
    if not caller.rates:
        raise APIError(403, "an agent's session key cannot rate or close its session", code="permission_denied")


@router.post("/v1/feedback", openapi_extra=request_body(FeedbackRequest))
async def feedback(request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    caller = await gw.authenticate(request)
    _rates(caller)
    body = await gw.read(request, FeedbackRequest)
    session_id = body.session_id or (None if body.completion_id else caller.session_id)
    if session_id is None and body.completion_id is None:
        raise APIError(400, "name the session_id (or completion_id) the feedback is about", param="session_id")
    if session_id is not None:
        _own(caller, session_id)
    try:
        if body.completion_id is not None and caller.session_id is not None:  # a per-session key: its own
            await gw.check_completion_session(caller.tenant, caller.session_id, body.completion_id)
        step_ids = await asyncio.to_thread(
            gw.pool.add_feedback, tenant=caller.tenant, session_id=session_id,
            turn_index=body.turn_index if session_id is not None else None,
            completion_id=body.completion_id if session_id is None else None,
            score=body.reward, correction=body.correction)
    except UnknownSessionError as exc:
        raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found") from exc
    except UnknownStepError as exc:
        raise APIError(404, f"no recorded turn matches ({exc.args[0]}); steps are stored right after each reply",
                       param="completion_id" if body.completion_id else "turn_index", code="turn_not_found") from exc
    return {"object": "feedback", "step_ids": step_ids, "reward": body.reward, "hint": bool(body.correction)}


@router.post("/v1/sessions/{session_id}/close", openapi_extra=request_body(CloseRequest))
async def close(session_id: str, request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    caller = await gw.authenticate(request)
    check_id(session_id, "session_id")
    _own(caller, session_id)
    _rates(caller)
    body = await gw.read(request, CloseRequest)
    weight = gw.config.reward.step_weight if body.step_weight is None else body.step_weight
    try:
        # As `Gateway.close_session`, with the step weight (the only close that carries one).
        was_open = await asyncio.to_thread(gw.pool.close_session, session_id, body.outcome_reward,
                                           tenant=caller.tenant, reason="closed", step_weight=weight)
    except UnknownSessionError as exc:
        raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found") from exc
    gw.sessions.forget(caller.tenant, session_id)
    shown = await asyncio.to_thread(gw.pool.show, session_id, caller.tenant, "session")
    turns = sum(1 for step in shown["steps"] if step["turn_type"] == "main")
    return {"id": session_id, "object": "session", "status": "closed", "was_open": was_open,
            "outcome_reward": body.outcome_reward, "step_weight": weight, "turns": turns}


@router.post("/v1/sessions", openapi_extra=request_body(AgentSession))
async def agent_session(request: Request) -> dict[str, Any]:
    """A session of the caller's tenant with an agent's key (`sk-clawr1-a-...`): requests with that key
    belong to the session, and it cannot rate it (feedback, close, `X-Session-Done`, AReaL's reward
    and end). Whoever holds the tenant's key does that: the black-box runner gives its agents such
    keys and closes each session with the task's outcome, so the model cannot score its own turns.
    The key is shown once; the pool stores only its sha256."""
    gw: Gateway = request.app.state.gateway
    caller = await gw.authenticate(request)
    if caller.session_id is not None:
        raise APIError(403, "a session key cannot create sessions", code="permission_denied")
    body = await gw.read(request, AgentSession)
    session_id = body.session_id or new_id("s-")
    key, digest = gw.new_session_key(session_id, rates=False)
    if not await asyncio.to_thread(gw.pool.open_session, session_id, tenant=caller.tenant, key_hash=digest):
        raise APIError(409, f"session {session_id!r} already exists", param="session_id", code="session_exists")
    gw.remember_session_key(digest, caller.tenant, session_id, rates=False)
    return {"id": session_id, "object": "session", "api_key": key, "created": int(time.time())}


@router.post("/admin/sessions", openapi_extra=request_body(NewSession))
async def create_session(request: Request) -> dict[str, Any]:
    """A new session with its own API key: requests with that key belong to it, whatever they send.
    The key is shown once; the pool stores only its sha256."""
    gw: Gateway = request.app.state.gateway
    gw.require_admin(request)
    body = await gw.read(request, NewSession)
    session_id = body.session_id or "s-" + uuid.uuid4().hex[:16]
    key, digest = gw.new_session_key(session_id)
    tenant = body.tenant
    if not await asyncio.to_thread(gw.pool.open_session, session_id, tenant=tenant, key_hash=digest):
        raise APIError(409, f"session {session_id!r} already exists", param="session_id", code="session_exists")
    gw.remember_session_key(digest, tenant, session_id)
    return {"id": session_id, "object": "session", "api_key": key, "created": int(time.time()),
            "paths": {"chat": "/v1/chat/completions", "close": f"/v1/sessions/{session_id}/close"}}


@router.get("/admin/sessions")
async def list_sessions(request: Request, limit: int = 100, tenant: str | None = None) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    gw.require_admin(request)
    if not 1 <= limit <= 10_000:
        raise APIError(400, "limit must be in [1, 10000]", param="limit")
    return {"object": "list", "data": await asyncio.to_thread(gw.pool.sessions, limit, tenant)}
