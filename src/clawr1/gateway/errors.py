"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a traceback, and
never a dropped connection: `CatchAll` answers whatever escapes a route (Starlette's own last
resort re-raises after answering, and uvicorn then closes the keep-alive connection, so the
client's next, valid, request would fail)."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawr1.core.types import EngineError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error", 410: "invalid_request_error",
          413: "invalid_request_error",
          429: "rate_limit_error", 502: "server_error", 503: "server_error", 504: "timeout_error"}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """Anthropic's shape, `{"type": "error", "error": {"type", "message"}}` (the Messages route and
    the front process answer `/v1/messages` in it); the engine's queue being full is
    `overloaded_error` (still 429, which clients retry), other 4xx are `invalid_request_error`,
    5xx `api_error`."""
    kind = "overloaded_error" if code == "engine_overloaded" else ANTHROPIC_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    """An error the gateway answers with directly."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")


def public(exc: APIError | EngineError) -> APIError | EngineError:
    """What a client may read of an error. A failure of the server's own side (an engine's, 5xx)
    carries its cause's text: a traceback's last line, a model path, an inference server's or a
    database's message. That goes to the log with a reference; the client gets the kind of failure,
    its code and the reference. A client's own error (4xx) is answered as it is."""
    if exc.status < 500 or isinstance(exc, APIError):  # the gateway's own words name no cause's text
        return exc
    reference = uuid.uuid4().hex[:12]
    log.error("engine error %s (%s): %s", reference, exc.code, exc.message)
    return APIError(exc.status, f"the engine failed while serving this request; the gateway's log has the "
                                f"details (error {reference})", code=exc.code, type=exc.type)


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status)


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], body: Any) -> M:
    """`model` from a parsed body, or a 400 naming the most specific field that is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = max(exc.errors(include_url=False, include_input=False), key=lambda e: len(e["loc"]))
        param = param_of(first["loc"])
        raise APIError(400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_value") from exc


def param_of(loc: tuple[Any, ...]) -> str | None:
    """`messages[0].content`, as OpenAI names parameters: pydantic's location without the names of
    union branches (`str`, `list[int]`, `function-after[...]`), which no field name looks like."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not ("[" in p or p in _BRANCHES):
            out += f".{p}" if out else p
    return out or None


_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none", "NamedToolChoice", "literal"}


def install(app: FastAPI) -> None:
    """Map every failure path to OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        shown = public(exc)
        return error_response(shown.status, shown.message, type=shown.type, param=shown.param, code=shown.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(400, f"{param or 'request'}: {first.get('msg')}", param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "unknown_route" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), code=code)



class CatchAll:
    """The innermost last resort: an exception that escapes a route is logged and answered 500 in
    the route's shape (Anthropic's on `/v1/messages`), or, when the response had started, the
    body is ended cleanly; nothing is re-raised to the server."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "done": False}

        async def tracked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.exception("unhandled error in the gateway (%s %s)", scope.get("method"), scope.get("path"))
            if state["done"]:
                return
            if state["started"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            message = f"internal error ({type(exc).__name__}); see the server log"
            if scope.get("path", "").endswith("/v1/messages"):
                body: dict[str, Any] = {"type": "error", "error": {"type": "api_error", "message": message}}
            else:
                body = error_body(500, message, code="internal_error")
            data = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data, "more_body": False})
