"""rLLM's model gateway, drop-in for its agents: `GatewayClient.get_session_url(session_id)` hands
agents `{gateway}/sessions/{session_id}/v1`, so the OpenAI client posts to
`/sessions/{id}/v1/chat/completions` (and `/completions`, `/responses`); `POST /sessions`
(`{"session_id"?, "metadata"?}` -> `{"session_id"}`) creates one. The URL's session is taken as an
`X-Session-Id` header: one Claw-R1 session, its turns numbered and judged like any online session's.
rLLM's trace reads (`GET /sessions/{id}/traces`) are not served: the trainer here reads the pool.

The app includes this router before the generation routes: `/sessions/{id}/v1/chat/completions`
also has the shape of `/{traj}/{prompt}/v1/chat/completions` (a trajectory called "sessions")."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from clawr1.gateway import schema
from clawr1.gateway.errors import APIError
from clawr1.gateway.pipeline import Wire, handle
from clawr1.gateway.service import Gateway
from clawr1.gateway.wire.chat import CHAT
from clawr1.gateway.wire.completions import COMPLETIONS
from clawr1.gateway.wire.responses import RESPONSES, ResponsesRequest

router = APIRouter()


class NewSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:-]+$")
    metadata: dict[str, Any] | None = None  # accepted, not used


@router.post("/sessions", openapi_extra=schema.request_body(NewSession))
async def create_session(request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    caller = await gw.authenticate(request)
    if caller.session_id is not None:
        raise APIError(403, "a session key cannot create sessions", code="permission_denied")
    body = await gw.read(request, NewSession)
    session_id = body.session_id or uuid.uuid4().hex
    if not await asyncio.to_thread(gw.pool.open_session, session_id, tenant=caller.tenant, key_hash=None):
        raise APIError(409, f"session {session_id!r} already exists", param="session_id", code="session_exists")
    return {"session_id": session_id}


def _handler(wire: Wire) -> Any:
    async def route(session_id: str, request: Request) -> Any:
        schema.check_id(session_id, "session_id")
        return await handle(request, wire, None, session=session_id)
    return route


for _path, _wire, _body in (("/chat/completions", CHAT, schema.ChatRequest),
                            ("/completions", COMPLETIONS, schema.CompletionRequest),
                            ("/responses", RESPONSES, ResponsesRequest)):
    router.add_api_route("/sessions/{session_id}/v1" + _path, _handler(_wire), methods=["POST"],
                         name="rllm_" + _path.strip("/").replace("/", "_"), openapi_extra=schema.request_body(_body))
