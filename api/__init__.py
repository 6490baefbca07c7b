"""The FastAPI gateway: app factory, one router module per resource, auth dependencies, the SSE
proxy, OpenAI-shaped errors."""

from tidal.api.app import create_app

__all__ = ["create_app"]
