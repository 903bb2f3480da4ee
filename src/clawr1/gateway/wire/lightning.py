"""Agent Lightning's per-rollout base URL: its `ProxyLLM.get_base_url(rollout_id, attempt_id)`
gives agents `{endpoint}/rollout/{rollout_id}/attempt/{attempt_id}/v1` (without the `/v1` when the
endpoint had none), so the OpenAI client posts to `/rollout/{r}/attempt/{a}/v1/chat/completions`.

Served as the path ids of Claw-R1's `/{session}/{prompt}` routes: an attempt is a session
(`{rollout_id}:{attempt_id}`: a retried attempt is a trajectory of its own) and the rollout is
the prompt id, so the attempts of one rollout are alternatives to the same prompt (a GRPO group)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from clawr1.gateway import schema
from clawr1.gateway.pipeline import Wire, handle
from clawr1.gateway.wire.chat import CHAT
from clawr1.gateway.wire.completions import COMPLETIONS
from clawr1.gateway.wire.responses import RESPONSES, ResponsesRequest

router = APIRouter()
PREFIX = "/rollout/{rollout_id}/attempt/{attempt_id}"


def _handler(wire: Wire) -> Any:
    async def route(rollout_id: str, attempt_id: str, request: Request) -> Any:
        return await handle(request, wire, (f"{rollout_id}:{attempt_id}", rollout_id))
    return route


def _routes(path: str, wire: Wire, body: Any) -> None:
    name = path.strip("/").replace("/", "_")
    for prefix, suffix in ((PREFIX + "/v1", "_v1"), (PREFIX, "")):
        router.add_api_route(prefix + path, _handler(wire), methods=["POST"], name=f"lightning_{name}{suffix}",
                             openapi_extra=schema.request_body(body))


_routes("/chat/completions", CHAT, schema.ChatRequest)
_routes("/completions", COMPLETIONS, schema.CompletionRequest)
_routes("/responses", RESPONSES, ResponsesRequest)
