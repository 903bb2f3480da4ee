"""`POST /internal/match`, on a worker of `gateway.workers` only: which open session a request
would continue (or, for an agent's summarising call, summarises), asked by the front process when
the request's first message no longer says where its session lives (`dispatch.Route.ask`: a
compaction). Nothing is numbered or stored. It needs the front's key (`x-clawr1-internal`) and
the caller's own key, and the request must pass the limits it would meet as itself (body size and
depth, the context check), so no transcript longer than a request may be is searched."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Request

from clawr1.core.types import EngineError
from clawr1.gateway.body import read_json
from clawr1.gateway.dispatch import KEY_HEADER, PATH_HEADER
from clawr1.gateway.errors import APIError, validate
from clawr1.gateway.matcher import is_summariser_call
from clawr1.gateway.pipeline import Wire, body_session_fields, check_context
from clawr1.gateway.service import Gateway, client_of
from clawr1.gateway.wire.anthropic import MESSAGES
from clawr1.gateway.wire.chat import CHAT
from clawr1.gateway.wire.responses import RESPONSES

WIRES: dict[str, Wire] = {"/v1/chat/completions": CHAT, "/chat/completions": CHAT, "/v1/messages": MESSAGES,
                          "/v1/responses": RESPONSES, "/responses": RESPONSES}

router = APIRouter()


@router.post("/internal/match", include_in_schema=False)
async def match(request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gateway
    given = request.headers.get(KEY_HEADER, "")
    if gw.internal_key is None or not hmac.compare_digest(given.encode(), gw.internal_key.encode()):
        raise APIError(401, "internal route", code="invalid_api_key")
    wire = WIRES.get(request.headers.get(PATH_HEADER, ""))
    if wire is None:
        return {"session_id": None}
    caller = await gw.caller(wire.token(request), client_of(request))
    body = await read_json(request, gw.config.gateway.max_body_bytes, gw.config.gateway.max_json_depth)
    headers = body_session_fields(body, {k.lower(): v for k, v in request.headers.items()})
    req = validate(wire.request_model, body)
    try:
        check_context(gw, wire.prepare(gw, req, caller, headers, None))
    except (APIError, EngineError):  # the request is refused as itself wherever it goes
        return {"session_id": None}
    messages = wire.messages(req)
    if is_summariser_call(messages):
        return {"session_id": gw.sessions.summarised(caller.tenant, messages)}
    who = gw.sessions.identify(caller.tenant, messages, headers, None, caller.session_id)
    return {"session_id": who.session_id if who.how in ("matched", "edited", "compacted") else None}
