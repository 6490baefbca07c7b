"""The gateway application factory.

Example::

    app = create_app(load_fleet("fleet.yaml"), Settings())
    uvicorn.run(app, port=8000)
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import cast

from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from tidal import __version__
from tidal.api.auth import KeyStore
from tidal.api.batch_tier import install_batch_tier
from tidal.api.errors import install_error_handlers
from tidal.api.fastpath import FAST_ROUTES, InferenceEndpoint
from tidal.api.interactive import InteractiveService
from tidal.api.limits import BodyLimit, BodyTooLarge, body_too_large
from tidal.api.routes import ROUTERS
from tidal.api.state import GatewayState
from tidal.fleet import FleetConfig
from tidal.settings import Settings

__all__ = ["GatewayApp", "create_app"]


class _FastRoutes:
    """The innermost of the gateway's middleware: ``POST`` requests to the inference paths go to
    their :class:`~api.fastpath.InferenceEndpoint`, which hands what it does not take, like every
    other request, to FastAPI's routing (``app``)."""

    def __init__(self, app: ASGIApp, gateway: GatewayApp) -> None:
        self.app = app
        state: GatewayState = gateway.state.tidal
        limit = state.fleet.gateway.max_body_bytes
        self.routes = {
            path: InferenceEndpoint(path, model, state, app, limit) for path, model in FAST_ROUTES.items()
        }
        gateway.fast_routes = MappingProxyType(self.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope.get("tidal.fast", True):
            endpoint = self.routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Middleware known never to wrap ``send``: with only these, the proxy writes body chunks with the
# server's own ``send`` (``tidal.send``), or its body writer (``tidal.write``,
# :class:`~api.protocol.BodyWriter`), past the wrappers that only watch for the response start.
_SEND_TRANSPARENT: tuple[type, ...] = (BodyLimit,)


class GatewayApp(FastAPI):
    """FastAPI, with the inference routes served by a raw ASGI endpoint (:mod:`api.fastpath`)
    inside the same middleware stack: middleware added with ``add_middleware`` (access log,
    CORS, tracing, request id) applies to every route, streams included.

    When every middleware is one known not to wrap ``send``, the server's own ``send`` goes in
    the scope (``tidal.send``) and the streaming proxy writes body chunks with it, or with the
    server protocol's body writer (``tidal.write``) where there is one; with any other middleware
    the writer is taken out of the scope, and the middleware sees every chunk."""

    fast_routes: Mapping[str, InferenceEndpoint] = MappingProxyType({})  # set with the stack
    raw_send = False

    def build_middleware_stack(self) -> ASGIApp:
        self.user_middleware.append(Middleware(_FastRoutes, gateway=self))
        try:
            stack = super().build_middleware_stack()
        finally:
            self.user_middleware.pop()
        self.raw_send = all(cast(object, m.cls) in _SEND_TRANSPARENT for m in self.user_middleware)
        return stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        if not (self.raw_send and scope["type"] == "http"):
            scope.pop("tidal.write", None)  # a middleware that wraps send must see every chunk
            await super().__call__(scope, receive, send)
            return
        scope["tidal.send"] = send
        try:
            await super().__call__(scope, receive, send)
        finally:
            # (the server's send holds its cycle, which holds the scope: left there, the three
            # would wait for the garbage collector instead of going with the request)
            scope.pop("tidal.send", None)

    async def full_stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The application with the inference routes served by FastAPI's own routes (what the
        documented routes answer; the raw path must answer the same)."""
        scope["tidal.fast"] = False
        await self(scope, receive, send)

    def endpoints(self) -> Mapping[str, InferenceEndpoint]:
        """The inference endpoints (building the middleware stack, after which no middleware can
        be added)."""
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        return self.fast_routes


def create_app(fleet: FleetConfig, settings: Settings, *, keys: KeyStore | None = None) -> FastAPI:
    """Build the gateway for ``fleet``. ``keys`` defaults to the fleet's tenants plus the admin and
    development keys from the environment (``TIDAL_ADMIN_KEY``, ``TIDAL_DEV_API_KEY``)."""
    keys = keys or KeyStore.from_fleet(
        fleet, admin_key=settings.admin_key, dev_key=os.environ.get("TIDAL_DEV_API_KEY")
    )
    state = GatewayState(fleet=fleet, settings=settings, keys=keys)
    state.interactive = InteractiveService(fleet, settings, state.metrics)
    state.on_startup.append(state.interactive.startup)
    state.on_shutdown.append(state.interactive.shutdown)
    install_batch_tier(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for hook in state.on_startup:
            await hook()
        try:
            yield
        finally:
            for hook in reversed(state.on_shutdown):
                await hook()

    app = GatewayApp(
        title="Tidal gateway",
        version=__version__,
        description="OpenAI-compatible gateway for interactive and batch LLM work on one GPU pool.",
        lifespan=lifespan,
    )
    app.state.tidal = state
    install_error_handlers(app)
    # File uploads have their own limit (TIDAL_MAX_FILE_BYTES, enforced as they stream in).
    app.add_middleware(BodyLimit, max_body_bytes=fleet.gateway.max_body_bytes, exempt=("/v1/files",))
    app.add_exception_handler(BodyTooLarge, body_too_large)
    for router in ROUTERS:
        app.include_router(router)
    return app
