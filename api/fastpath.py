"""The inference routes as raw ASGI endpoints, served ahead of FastAPI's routing.

``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` carry nearly all of the
gateway's traffic. Through FastAPI each request pays for the middleware stack, route matching,
dependency solving and ``json.loads`` plus validation of the body in Python, and every
resumption of a streaming request's task walks back up through those frames. Here a request
that is well-formed and authorised goes from the server to
:meth:`~api.interactive.InteractiveService.prepare` and the proxy directly: the body is read
under the same size limit, the key checked by :func:`~api.auth.bearer_principal`, the body
parsed and validated in one step by pydantic-core (``model_validate_json``).

Whatever this path does not accept as it stands -- a body over the limit by its
``Content-Length``, a content type other than JSON, a missing or unknown key, a body that does
not validate, a gateway without the interactive path -- goes to the FastAPI application
unchanged (the body already read is replayed to it), so every refusal keeps exactly the status,
OpenAI-shaped body and order of checks of the documented routes, which also keep describing the
endpoints in the OpenAPI schema. Refusals after validation (unknown model, context cap, feature
not allowed) are the same :class:`~api.errors.APIError` responses FastAPI's handler sends.

Example::

    fast = InferenceEndpoint("/v1/chat/completions", ChatCompletionRequest, state, fallback, limit)
    await fast(scope, receive, send)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidal.api.auth import bearer_principal
from tidal.api.errors import APIError, error_body
from tidal.api.limits import BodyTooLarge
from tidal.api.proxy import ProxyResponse
from tidal.api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tidal.api.state import GatewayState

__all__ = ["FAST_ROUTES", "InferenceEndpoint"]

log = logging.getLogger(__name__)

FAST_ROUTES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}


class _Fallback(Exception):
    """This request goes through the FastAPI application instead."""


class InferenceEndpoint:
    """One inference route as a raw ASGI endpoint; ``fallback`` (the FastAPI application, with
    its middleware) answers every request this one does not take as it stands."""

    def __init__(
        self,
        path: str,
        model: type[BaseModel],
        state: GatewayState,
        fallback: ASGIApp,
        max_body_bytes: int,
    ) -> None:
        self.path = path
        self.model = model
        self.state = state
        self.fallback = fallback
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_body_bytes
        content_type = b""
        authorization = b""
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False
                if too_big:  # the body-limit middleware answers it before reading the body
                    await self.fallback(scope, receive, send)
                    return
            elif name == b"content-type":
                content_type = value
            elif name == b"authorization":
                authorization = value
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await receive()
            except BodyTooLarge:
                message = {"type": "http.request", "body": b"", "more_body": False}
                size = limit + 1
            if message["type"] != "http.request":
                return  # the client went away before its body arrived
            piece: bytes = message.get("body", b"")
            size += len(piece)  # (the body-limit middleware counts too, and raises first)
            if size > limit:
                error = APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
                await error.response()(scope, receive, send)
                return
            chunks.append(piece)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            response = self._prepare(scope, body, content_type, authorization)
        except _Fallback:
            await self.fallback(scope, _replay(body, receive), send)
            return
        except APIError as exc:
            await exc.response()(scope, receive, send)
            return
        await self._respond(response, scope, receive, send)

    def _prepare(self, scope: Scope, body: bytes, content_type: bytes, authorization: bytes) -> ProxyResponse:
        service = self.state.interactive
        if service is None or content_type.partition(b";")[0].strip().lower() != b"application/json":
            raise _Fallback
        try:
            principal = bearer_principal(self.state.keys, authorization.decode("latin-1"))
            request = self.model.model_validate_json(body)
        except (APIError, ValidationError, ValueError):
            raise _Fallback from None
        assert isinstance(request, ChatCompletionRequest | CompletionRequest | EmbeddingRequest)
        return service.prepare(self.path, request, principal, Headers(scope=scope))

    async def _respond(self, response: ProxyResponse, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        response.bind(scope)
        try:
            await response.watched(receive, tracked)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error on POST %s", self.path)
            if started:
                raise
            await JSONResponse(
                error_body(500, "internal error; the request may be retried"), status_code=500
            )(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the fallback: the body already read, then the client's own messages."""
    pending: list[Any] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            message: Message = pending.pop()
            return message
        return await receive()

    return replay
