"""Request size limit as pure ASGI middleware (no per-request task, no wrapping of ``send``).

A body larger than ``max_body_bytes`` -- by its ``Content-Length``, or as it arrives -- gets an
OpenAI-shaped 413 before any handler parses it (paths under ``exempt`` -- file uploads, which
enforce their own, larger limit -- pass through): the first case is answered here, the second
raises :class:`BodyTooLarge` from ``receive`` while FastAPI reads the body, and the error
handlers turn it into the same 413.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidal.api.errors import APIError, error_body

__all__ = ["BodyLimit", "BodyTooLarge", "body_too_large"]


class BodyTooLarge(HTTPException):
    """Raised from ``receive``: an ``HTTPException``, so FastAPI's body parser lets it pass instead
    of reporting a parse error; :func:`body_too_large` answers it."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body exceeds {limit} bytes.")


async def body_too_large(request: Request, exc: Exception) -> Response:
    """The exception handler for :class:`BodyTooLarge` (an OpenAI-shaped 413)."""
    assert isinstance(exc, BodyTooLarge)
    return APIError(413, str(exc.detail), code="request_too_large").response()


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.exempt and scope["path"].startswith(self.exempt)):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False
                if too_big:
                    data = json.dumps(
                        error_body(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
                    ).encode()
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 413,
                            "headers": [
                                (b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()),
                            ],
                        }
                    )
                    await send({"type": "http.response.body", "body": data})
                    return
                break
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)
