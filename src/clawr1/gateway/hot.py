"""The ASGI app the gateway's server runs, in front of FastAPI (`HotRoutes`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from clawr1.gateway import browsers
from clawr1.gateway.errors import error_body
from clawr1.gateway.pipeline import Exchange, Wire, _internal, handle

log = logging.getLogger("clawr1.gateway.pipeline")  # its records read as the pipeline's, as before


class HotRoutes:
    """The ASGI app the server runs, in front of FastAPI: the plain generation routes (`POST
    /v1/chat/completions` and the like, no ids in the path) go straight to `handle`, skipping
    FastAPI's own layers (server errors, body limit, telemetry, exit stack) and its router (a regex
    match over every route, dependency solving): measured, those were about a third of the
    gateway's CPU a request. What the metrics and error layers do for every other route is done
    inline here, with no wrapper around `send` (each wrapper is a closure and an await per message
    sent): the request is counted and timed under the FastAPI route that serves the same path (so
    `/metrics` and the OpenAPI schema are unchanged), with the status the response sent, and a bug
    before the exchange began is a 500 in the route's error shape. Everything else (other paths and
    methods, lifespan) goes to FastAPI. `state` is FastAPI's (`state.gateway`). `refuse_pages`: a
    gateway with no keys, where every HTTP request first passes `browsers.refusal`."""

    def __init__(self, app: Any, routes: dict[str, tuple[Wire, Any]], metrics: Any = None,
                 refuse_pages: bool = False):
        self.app, self.routes, self.state = app, routes, app.state  # path -> (wire, FastAPI route)
        self.metrics = metrics  # `GatewayMetrics`
        self.refuse_pages = refuse_pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.refuse_pages and scope["type"] == "http":
            named = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _BROWSER_HEADERS}
            refused = browsers.refusal(scope["method"], named)
            if refused is not None:
                wire = self.routes.get(scope["path"])
                await (wire[0].error_response(refused) if wire else
                       JSONResponse(error_body(refused.status, refused.message, code=refused.code),
                                    status_code=refused.status))(scope, receive, send)
                return
        hit = None
        if scope["type"] == "http" and scope["method"] == "POST":
            path, root = scope["path"], scope.get("root_path", "")
            hit = self.routes.get(path[len(root):] if root and path.startswith(root) else path)
        if hit is None:
            await self.app(scope, receive, send)
            return
        # What FastAPI would have set: the app (`request.app`) and the route (the metrics' label).
        scope["app"], scope["route"] = self.app, hit[1]
        started = time.perf_counter()
        response: Response | None = None
        try:
            try:
                response = await handle(Request(scope, receive), hit[0], None)
            except Exception as exc:  # a bug before the exchange began (`Exchange` answers its own)
                log.exception("unhandled error in the gateway (POST %s)", scope["path"])
                response = hit[0].error_response(_internal(exc))
            await response(scope, receive, send)
        except Exception as exc:  # raised after the answer was under way (a settle that failed): as CatchAll
            log.exception("unhandled error in the gateway (POST %s)", scope["path"])
            if isinstance(response, Exchange):
                await response._error(_internal(exc))  # whatever of the answer is still unsent
        finally:
            if self.metrics is not None:
                self.metrics.request_done(hit[1].path, 500 if response is None else response.status_code,
                                          time.perf_counter() - started)


_BROWSER_HEADERS = frozenset({b"host", b"origin", b"sec-fetch-site"})
