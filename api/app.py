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

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from api.auth import KeyStore
from api.batch_tier import install_batch_tier
from api.errors import install_error_handlers
from api.fastpath import FAST_ROUTES, InferenceEndpoint
from api.interactive import InteractiveService
from api.limits import BodyLimit, BodyTooLarge, body_too_large
from api.routes import ROUTERS
from api.state import GatewayState
from tidal import __version__
from tidal.fleet import FleetConfig
from tidal.settings import Settings

__all__ = ["GatewayApp", "create_app"]


class GatewayApp(FastAPI):
    """FastAPI, with the inference routes served ahead of it (:mod:`api.fastpath`: ``POST``
    requests to those paths go to their :class:`~api.fastpath.InferenceEndpoint`, which hands
    what it does not take to :meth:`full_stack`), plus the server's own ``send`` in the scope
    (``tidal.send``): the streaming proxy writes body chunks with it, past the middleware
    wrappers that only watch for the response start (which still goes through them)."""

    fast_routes: Mapping[str, InferenceEndpoint] = MappingProxyType({})  # set by create_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.full_stack(scope, receive, send)

    async def full_stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The FastAPI application with its middleware (every route, every error handler)."""
        scope["tidal.send"] = send
        await super().__call__(scope, receive, send)


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
    app.fast_routes = {
        path: InferenceEndpoint(path, model, state, app.full_stack, fleet.gateway.max_body_bytes)
        for path, model in FAST_ROUTES.items()
    }
    return app
