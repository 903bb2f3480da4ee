"""The gateway app: assembles the routers around one `Gateway` (`service.py`). Routes import the
serving layer (`service.py`, `pipeline.py`), never this module.

Every generation route (chat, completions, Anthropic Messages, Responses, and the agent frameworks'
URL schemes over them: one module each in `wire/`) runs through one request pipeline
(`pipeline.py`); the others are `lifecycle.py` (feedback, close, admin), `/metrics`, the dashboard,
`/v1/models` and `/healthz`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute, APIRouter

from clawr1.core.config import Config
from clawr1.datapool.base import DataPool
from clawr1.engine.base import Engine
from clawr1.gateway import errors, schema
from clawr1.gateway.hot import HotRoutes
from clawr1.gateway.ids import new_id
from clawr1.gateway.metrics import MetricsMiddleware
from clawr1.gateway.metrics import router as metrics_router
from clawr1.gateway.service import Caller, Gateway

__all__ = ["Caller", "Gateway", "create_app", "new_id"]  # older imports of these names keep working
log = logging.getLogger(__name__)


def create_app(engine: Engine, pool: DataPool, config: Config, worker: int = 0,
               internal_key: str | None = None) -> HotRoutes:
    """The gateway's ASGI app: FastAPI with every route, behind `HotRoutes` (the plain generation
    routes straight to the pipeline, counted and guarded as the metrics and error layers would). `.state.gateway` is the
    `Gateway`. With `gateway.workers` > 1: this process's index, and the key the front process
    asks `/internal/match` with."""
    from clawr1.gateway import dashboard, lifecycle, quality_routes
    from clawr1.gateway.wire import anthropic, areal, chat, completions, lightning, responses, rllm

    gateway = Gateway(engine, pool, config, worker, internal_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        restored = await asyncio.to_thread(gateway.restore_sessions)
        if restored:
            log.info("restored %d open sessions for history matching", restored)
        gateway.usage = await asyncio.to_thread(pool.tenant_usage)
        await asyncio.to_thread(gateway.memory.refresh)  # every user's active memory entries
        background = [asyncio.create_task(gateway.sweep_idle()), asyncio.create_task(gateway.watch_versions()),
                      asyncio.create_task(gateway.watch_usage()), asyncio.create_task(gateway.memory.watch())]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, *gateway._tasks, return_exceptions=True)

    app = FastAPI(title="Claw-R1 gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        """Liveness for anyone. Which versions are loaded, only where nobody may not know them all:
        a gateway with no agent keys (loopback only), or the admin (a tenant never learns of
        another's adapter, as on `/v1/models`)."""
        if gateway.agent_keys and not gateway.is_admin(request):
            return {"ok": True}
        return {"ok": True, "adapters": engine.adapters()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        caller = await gateway.authenticate(request)
        mine = gateway.adapter_of(caller.tenant)  # a tenant never learns of another's adapter
        ids = [config.engine.model] + [name for name in sorted(engine.adapters()) if name == mine]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "clawr1"} for i in ids]}

    app.include_router(rllm.router)  # first: `/sessions/{id}/v1/...` has the shape of `/{traj}/{prompt}/v1/...`
    app.include_router(chat.router)
    app.include_router(areal.chat_router)  # before `/{traj}/{prompt}/completions`: see wire/areal.py
    app.include_router(completions.router)
    app.include_router(lifecycle.router)
    app.include_router(quality_routes.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.include_router(lightning.router)
    app.include_router(metrics_router)
    app.include_router(dashboard.router)
    if config.gateway.workers > 1:
        from clawr1.gateway import internal

        app.include_router(internal.router)
    app.include_router(areal.router)  # last: its /{session_id}/... routes must not shadow others
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    hot = {"/v1/chat/completions": (chat.CHAT, chat.router), "/v1/completions": (completions.COMPLETIONS,
           completions.router), "/v1/messages": (anthropic.MESSAGES, anthropic.router),
           "/v1/responses": (responses.RESPONSES, responses.router)}
    errors.install(app)
    app.add_middleware(errors.CatchAll)  # inside the metrics, so what it answers is counted
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)
    # Behind a front (`gateway.workers` > 1) the front, which faces the browsers, checks them.
    open_gateway = not gateway.agent_keys and config.gateway.workers == 1
    return HotRoutes(app, {path: (wire, _route(router, path)) for path, (wire, router) in hot.items()},
                     gateway.metrics, refuse_pages=open_gateway)


def _route(router: APIRouter, path: str) -> APIRoute:
    """The POST route of `router` at `path`."""
    [route] = [r for r in router.routes if isinstance(r, APIRoute) and r.path == path and "POST" in r.methods]
    return route


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies the generation routes read themselves (they bound
    size and depth before parsing, so FastAPI never sees their models)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        spec.setdefault("components", {}).setdefault("schemas", {}).update(schema.openapi_components())
        app.openapi_schema = spec
    return app.openapi_schema
