"""One ``APIRouter`` per resource; :data:`ROUTERS` is the list the app factory mounts, in order."""

from __future__ import annotations

from fastapi import APIRouter

from tidal.api.routes import admin, batches, chat, completions, embeddings, files, health, jobs, models

__all__ = ["ROUTERS"]

ROUTERS: list[APIRouter] = [health.router]
ROUTERS += [chat.router, completions.router, embeddings.router, models.router, admin.router]
ROUTERS += [files.router, batches.router, jobs.router]
