"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawr1.core.types import EngineError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 502: "server_error", 503: "server_error", 504: "timeout_error"}


class APIError(Exception):
    """An error the gateway answers with directly."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status)


def install(app: FastAPI) -> None:
    """Map every failure path to OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(400, f"{param or 'request'}: {first.get('msg')}", param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "unknown_route" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the gateway")
        return error_response(500, f"internal error ({type(exc).__name__}); see the server log", code="internal_error")
