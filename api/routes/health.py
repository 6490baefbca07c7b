"""Liveness and Prometheus metrics of the gateway itself."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tidal.api.deps import StateDep

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: 200 while the gateway runs")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics", summary="Prometheus metrics of the gateway (tidal_gateway_*)")
async def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.metrics), media_type=CONTENT_TYPE_LATEST)
