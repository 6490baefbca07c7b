"""The gateway application factory.

Example::

    app = create_app(load_fleet("fleet.yaml"), Settings())
    uvicorn.run(app, port=8000)
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.auth import KeyStore
from api.batch_tier import install_batch_tier
from api.errors import install_error_handlers
from api.routes import ROUTERS
from api.state import GatewayState
from tidal import __version__
from tidal.fleet import FleetConfig
from tidal.settings import Settings

__all__ = ["create_app"]


def create_app(fleet: FleetConfig, settings: Settings, *, keys: KeyStore | None = None) -> FastAPI:
    """Build the gateway for ``fleet``. ``keys`` defaults to the fleet's tenants plus the admin and
    development keys from the environment (``TIDAL_ADMIN_KEY``, ``TIDAL_DEV_API_KEY``)."""
    keys = keys or KeyStore.from_fleet(
        fleet, admin_key=settings.admin_key, dev_key=os.environ.get("TIDAL_DEV_API_KEY")
    )
    state = GatewayState(fleet=fleet, settings=settings, keys=keys)
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

    app = FastAPI(
        title="Tidal gateway",
        version=__version__,
        description="OpenAI-compatible gateway for interactive and batch LLM work on one GPU pool.",
        lifespan=lifespan,
    )
    app.state.tidal = state
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
