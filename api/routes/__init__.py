"""One ``APIRouter`` per resource; :data:`ROUTERS` is the list the app factory mounts, in order."""

from __future__ import annotations

from fastapi import APIRouter

from api.routes import admin, chat, completions, embeddings, health, models

__all__ = ["ROUTERS"]

ROUTERS: list[APIRouter] = [
    health.router,
    chat.router,
    completions.router,
    embeddings.router,
    models.router,
    admin.router,
]
