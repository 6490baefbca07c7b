"""The admin API (``/admin``, admin key only): replicas at run time and the load signal.

The scheduler's health prober, canary controller, autoscaler actuator and batch gate use it:

* ``GET /admin/replicas`` -- every replica with its state, cap, adapters and last snapshot;
* ``POST /admin/replicas`` -- register one (``name``, http(s) ``url``, existing ``pool``,
  ``group`` = stable, ``weight`` = 1, ``max_loras`` = 0); 409 if the name exists;
* ``PATCH /admin/replicas/{name}`` -- ``healthy`` (false: out of routing at once and its
  in-flight requests fail fast), ``draining`` (no new requests), ``weight`` (canary split);
* ``DELETE /admin/replicas/{name}`` -- drain, then deregister; answers 200 once removed, or 202
  when ``timeout_s`` passed first (removal completes in the background when the last request ends);
* ``GET /admin/load`` -- per pool: queue depth, queue wait / TTFT / TPOT p95 over a 5 s window,
  in-flight, KV usage max/mean, scraped waiting, healthy/total replicas, requests/s, error rate;
  per canary group: cumulative ``requests`` and ``errors`` and the windowed ``error_rate``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, UrlConstraints

from api.deps import AdminDep, InteractiveDep

__all__ = ["router"]

router = APIRouter(prefix="/admin", tags=["admin"])

_Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]
_Url = Annotated[AnyHttpUrl, UrlConstraints(allowed_schemes=["http", "https"])]


class ReplicaCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: _Name
    url: _Url
    pool: _Name
    group: _Name = "stable"
    weight: float = Field(default=1.0, ge=0.0, le=1000.0)
    max_loras: int = Field(default=0, ge=0, le=1024)


class ReplicaPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    healthy: bool | None = None
    weight: float | None = Field(default=None, ge=0.0, le=1000.0)
    draining: bool | None = None


@router.get("/replicas", summary="Every replica with its live state")
async def list_replicas(admin: AdminDep, service: InteractiveDep) -> dict[str, Any]:
    return {"data": [service.replica_json(s) for s in service.registry]}


@router.post("/replicas", status_code=201, summary="Register a replica at run time")
async def add_replica(body: ReplicaCreate, admin: AdminDep, service: InteractiveDep) -> dict[str, Any]:
    state = service.add_replica(
        name=body.name,
        url=str(body.url),
        pool=body.pool,
        group=body.group,
        weight=body.weight,
        max_loras=body.max_loras,
    )
    return service.replica_json(state)


@router.patch("/replicas/{name}", summary="Mark healthy/unhealthy, drain, or set the canary weight")
async def patch_replica(
    name: str, body: ReplicaPatch, admin: AdminDep, service: InteractiveDep
) -> dict[str, Any]:
    state = service.patch_replica(name, healthy=body.healthy, draining=body.draining, weight=body.weight)
    return service.replica_json(state)


@router.delete("/replicas/{name}", summary="Drain, then deregister a replica")
async def delete_replica(
    name: str,
    admin: AdminDep,
    service: InteractiveDep,
    response: Response,
    timeout_s: Annotated[float, Query(ge=0, le=600)] = 30.0,
) -> dict[str, Any]:
    removed, inflight = await service.remove_replica(name, timeout_s)
    if not removed:
        response.status_code = 202
    return {"name": name, "removed": removed, "inflight": inflight}


@router.get("/load", summary="Load signals per pool and canary group (poll every 250 ms)")
async def load(admin: AdminDep, service: InteractiveDep) -> dict[str, Any]:
    return service.load_json()


@router.get("/router", summary="The router's profiles and plugins")
async def router_profiles(admin: AdminDep, service: InteractiveDep) -> dict[str, Any]:
    return {"default": service.router.default, "profiles": service.router.describe()}
