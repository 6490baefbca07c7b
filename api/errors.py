"""OpenAI-shaped errors: every failure the gateway produces is ``{"error": {message, type, param, code}}``.

Handlers registered by :func:`install_error_handlers` turn FastAPI's validation errors (400, as
vLLM and OpenAI answer), HTTP exceptions and :class:`APIError` into that shape, so no request
ever gets a bare 500 page or a FastAPI ``{"detail": ...}``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "error_body", "install_error_handlers"]

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
    507: "server_error",
}


def error_body(
    status: int, message: str, *, type_: str | None = None, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_ or _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class APIError(Exception):
    """Raise from anywhere in a request to answer with an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.status, self.message, type_=self.type_, param=self.param, code=self.code),
            status_code=self.status,
            headers=self.headers,
        )


def _loc(loc: Any) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _loc(first.get("loc", ())) or None
    lines = [f"{_loc(e.get('loc', ())) or '(body)'}: {e.get('msg', 'invalid')}" for e in errors[:10]]
    message = "; ".join(lines) or "invalid request"
    return JSONResponse(error_body(400, message, param=param, code="invalid_request"), status_code=400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return JSONResponse(
        error_body(exc.status_code, message),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(error_body(500, "internal error; the request may be retried"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
