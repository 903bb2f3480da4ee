"""AReaL's online (proxy) mode, drop-in: an AReaL agent changes only the proxy's base URL.

AReaL's proxy (`areal/experimental/openai/proxy`) has two client generations, both served:
- key style (its rollout server now): `POST /rl/start_session {"task_id"}` with the admin key
  answers `{"session_id", "api_key"}`; the agent then calls `/chat/completions` (no `/v1`),
  `/responses`, `/v1/messages` and `POST /rl/set_reward {"interaction_id"?, "reward"}` and
  `POST /rl/end_session` with that session key as its Bearer token;
- path style (`OpenAIProxyClientSession`): the session's base URL is `{base}/{session_id}/`, so
  its calls go to `/{session_id}/chat/completions`, `/{session_id}/rl/set_reward` and
  `/{session_id}/rl/end_session`.

Mapping: a session is `{task_id}-{n}` (the first free n, as AReaL numbers them) with a Claw-R1
per-session key; in the path style the task is the prompt id, so the sessions of one task are a
GRPO group (AReaL samples several per task). A reward is explicit feedback on the interaction (a
completion or response id; none: the session's latest turn), in [-1, 1] like every reward here;
ending the session closes it (a last turn with no reward and no next state is masked, as on any
close). `/rl/start_session` takes the admin key as AReaL sends it, or an agent key.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from clawr1.core.records import DEFAULT_TENANT
from clawr1.datapool.base import UnknownSessionError, UnknownStepError
from clawr1.gateway import schema
from clawr1.gateway.errors import APIError
from clawr1.gateway.pipeline import Wire, handle
from clawr1.gateway.service import Caller, Gateway, client_of
from clawr1.gateway.wire.chat import CHAT
from clawr1.gateway.wire.completions import COMPLETIONS
from clawr1.gateway.wire.responses import RESPONSES, ResponsesRequest

router = APIRouter()
MAX_SESSIONS_PER_TASK = 100_000
TASKS_REMEMBERED = 65_536  # (tenant, task)s whose next session number is kept (oldest dropped first)


class StartSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    task_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:-]+$")
    api_key: str | None = None
    """AReaL's gateway may ask to reuse a key it issued; here every session gets a fresh key."""


class SetReward(BaseModel):
    model_config = ConfigDict(extra="ignore")
    interaction_id: str | None = Field(None, min_length=1, max_length=256)
    """The completion or response id; none: the session's latest turn."""
    reward: float = Field(ge=-1, le=1)


def _task_of(session_id: str) -> str:
    """`{task_id}-{n}` -> the task (the prompt the session's samples are alternatives to)."""
    task, _, n = session_id.rpartition("-")
    return task if task and n.isdigit() else session_id


async def _starter(gw: Gateway, request: Request) -> str:
    """The tenant a new session belongs to: AReaL sends the admin key; an agent key works too."""
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth.startswith("Bearer ") else ""
    admin = gw.config.gateway.admin_key
    if admin is not None and hmac.compare_digest(token.encode(), admin.encode()):
        return DEFAULT_TENANT
    caller = await gw.caller(token, client_of(request))
    if caller.session_id is not None:
        raise APIError(403, "a session key cannot start sessions", code="permission_denied")
    return caller.tenant


@router.post("/rl/start_session", openapi_extra=schema.request_body(StartSession))
async def start_session(request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    tenant = await _starter(gw, request)
    body = await gw.read(request, StartSession)
    if body.api_key is not None:
        raise APIError(400, "reusing a session key is not supported: omit api_key for a fresh one", param="api_key")
    # The task's next number, remembered: one write a session. Until 2026-12-07 every start tried
    # 0, 1, 2, ... in turn, a write each, so the n-th session of a task cost n writes.
    numbers = _numbers(request)
    n = numbers.pop((tenant, body.task_id), None)
    if n is None:  # not seen since the start: found with a few reads
        n = await asyncio.to_thread(_first_free, gw, tenant, body.task_id)
    while n < MAX_SESSIONS_PER_TASK:
        session_id = f"{body.task_id}-{n}"
        key, digest = gw.new_session_key(session_id)  # routes where the id does (`gateway.workers`)
        if await asyncio.to_thread(gw.pool.open_session, session_id, tenant=tenant, key_hash=digest):
            break
        n += 1  # made meanwhile (another process, or by its name through another route)
    else:
        raise APIError(409, f"task {body.task_id!r} has {MAX_SESSIONS_PER_TASK} sessions", param="task_id")
    numbers[(tenant, body.task_id)] = n + 1
    if len(numbers) > TASKS_REMEMBERED:
        del numbers[next(iter(numbers))]
    gw.remember_session_key(digest, tenant, session_id)
    return {"session_id": session_id, "api_key": key}


def _numbers(request: Request) -> dict[tuple[str, str], int]:
    """This app's next session number per (tenant, task), the most recently used last."""
    state = request.app.state
    if getattr(state, "areal_numbers", None) is None:
        state.areal_numbers = {}
    return state.areal_numbers


def _first_free(gw: Gateway, tenant: str, task: str) -> int:
    """The first n with no session `{task}-n`, in O(log n) reads: this route numbers a task's
    sessions from 0 with no gap, so doubling finds a free number and halving the first one (a gap
    someone made by naming a session so only makes it a free number, not the first)."""
    def taken(n: int) -> bool:
        try:
            gw.pool.show(f"{task}-{n}", tenant, "session")
        except KeyError:
            return False
        return True

    if not taken(0):
        return 0
    low, high = 0, 1  # low is taken, high is the candidate
    while high < MAX_SESSIONS_PER_TASK and taken(high):
        low, high = high, min(2 * high, MAX_SESSIONS_PER_TASK)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if taken(middle) else (low, middle)
    return high


async def _session(gw: Gateway, request: Request, path_session: str | None) -> Caller:
    """Whose session a reward or an end is about: the path's (path style) or the key's."""
    auth = request.headers.get("authorization", "")
    caller = await gw.caller(auth[7:].strip() if auth.startswith("Bearer ") else "", client_of(request))
    if not caller.rates:
        raise APIError(403, "an agent's session key cannot rate or end its session", code="permission_denied")
    session_id = path_session or caller.session_id
    if session_id is None:
        raise APIError(400, "authenticate with the session's api_key from /rl/start_session", code="invalid_api_key")
    schema.check_id(session_id, "session_id")
    if caller.session_id is not None and caller.session_id != session_id:
        raise APIError(403, "this session key belongs to another session", code="permission_denied")
    return Caller(caller.tenant, session_id)


async def _set_reward(request: Request, path_session: str | None) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    who = await _session(gw, request, path_session)
    body = await gw.read(request, SetReward)
    try:
        if body.interaction_id is not None:  # only an interaction of this session
            await gw.check_completion_session(who.tenant, who.session_id, body.interaction_id)
        step_ids = await asyncio.to_thread(
            gw.pool.add_feedback, tenant=who.tenant, session_id=None if body.interaction_id else who.session_id,
            turn_index=None, completion_id=body.interaction_id, score=body.reward, correction=None)
    except UnknownSessionError as exc:
        raise APIError(400, "No interactions in session", code="session_not_found") from exc
    except UnknownStepError as exc:
        raise APIError(400, f"Interaction {body.interaction_id} not found", param="interaction_id",
                       code="turn_not_found") from exc
    return {"message": "success", "step_ids": step_ids}


async def _end_session(request: Request, path_session: str | None) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    who = await _session(gw, request, path_session)
    assert who.session_id is not None
    try:
        was_open = await asyncio.to_thread(gw.pool.close_session, who.session_id, None, tenant=who.tenant,
                                           reason="closed")
    except UnknownSessionError as exc:
        raise APIError(410, f"Session {who.session_id} already ended or expired", code="session_not_found") from exc
    if not was_open:
        raise APIError(410, f"Session {who.session_id} already ended or expired", code="session_closed")
    gw.sessions.forget(who.tenant, who.session_id)
    shown = await asyncio.to_thread(gw.pool.show, who.session_id, who.tenant, "session")
    return {"message": "success", "interaction_count": sum(s["turn_type"] == "main" for s in shown["steps"])}


@router.post("/rl/set_reward", openapi_extra=schema.request_body(SetReward))
async def set_reward(request: Request) -> dict[str, Any]:
    return await _set_reward(request, None)


@router.post("/rl/end_session")
async def end_session(request: Request) -> dict[str, Any]:
    return await _end_session(request, None)


@router.post("/{session_id}/rl/set_reward", openapi_extra=schema.request_body(SetReward))
async def set_reward_in_path(session_id: str, request: Request) -> dict[str, Any]:
    return await _set_reward(request, session_id)


@router.post("/{session_id}/rl/end_session")
async def end_session_in_path(session_id: str, request: Request) -> dict[str, Any]:
    return await _end_session(request, session_id)


def _unprefixed(wire: Wire) -> Any:
    async def route(request: Request) -> Any:
        return await handle(request, wire, None)
    return route


def _in_path(wire: Wire) -> Any:
    async def route(session_id: str, request: Request) -> Any:
        return await handle(request, wire, (session_id, _task_of(session_id)), bare=True)
    return route


# `/{session}/chat/completions` has the shape of Claw-R1's `/{traj}/{prompt}/completions` (prompt
# "chat"): it is AReaL's, so the app includes `chat_router` before the completions routes. The rest
# goes last, after every fixed path (`/{session}/completions` must not catch `/v1/completions`).
chat_router = APIRouter()
chat_router.add_api_route("/{session_id}/chat/completions", _in_path(CHAT), methods=["POST"],
                          name="areal_chat_completions_in_path", openapi_extra=schema.request_body(schema.ChatRequest))
for _path, _wire, _body in (("/chat/completions", CHAT, schema.ChatRequest),
                            ("/completions", COMPLETIONS, schema.CompletionRequest),
                            ("/responses", RESPONSES, ResponsesRequest)):
    _name = _path.strip("/").replace("/", "_")
    # Key style: the base URL has no /v1 (the session comes from the key, or history matching).
    router.add_api_route(_path, _unprefixed(_wire), methods=["POST"], name=f"areal_{_name}",
                         openapi_extra=schema.request_body(_body))
    if _wire is not CHAT:
        router.add_api_route("/{session_id}" + _path, _in_path(_wire), methods=["POST"],
                             name=f"areal_{_name}_in_path", openapi_extra=schema.request_body(_body))
