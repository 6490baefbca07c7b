"""Liveness and Prometheus metrics of the gateway itself."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tidal.api.deps import StateDep

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: 200 while the gateway runs")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics", summary="Prometheus metrics of the gateway (tidal_gateway_*)")
async def metrics(
    state: StateDep,
    scope: Annotated[
        Literal["gateway", "process"], Query(description="process: this worker's alone")
    ] = "gateway",
) -> Response:
    """Under ``--workers N``, every worker's series, each labelled ``worker``
    (:mod:`api.worker_metrics`); ``scope=process``: only the answering worker's, unlabelled."""
    own = generate_latest(state.metrics)
    if state.workers is not None and scope == "gateway":
        own = await state.workers.merged(own)
    return Response(own, media_type=CONTENT_TYPE_LATEST)
