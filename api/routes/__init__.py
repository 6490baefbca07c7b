"""One ``APIRouter`` per resource; :data:`ROUTERS` is the list the app factory mounts, in order."""

from __future__ import annotations

from fastapi import APIRouter

from api.routes import batches, files, health, jobs

__all__ = ["ROUTERS"]

ROUTERS: list[APIRouter] = [health.router]
ROUTERS += [files.router, batches.router, jobs.router]
