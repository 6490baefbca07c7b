"""The admin API (``/admin``, admin key only): replicas at run time and the load signal.

The scheduler's health prober, canary controller, autoscaler actuator and batch gate use it:

* ``GET /admin/replicas`` -- every replica with its state, cap, adapters, last snapshot and KV-event
  subscription (``kv_events``: endpoints, blocks indexed, block size, complete, age, last
  sequence number, gaps, rebuilds, malformed; null when it publishes none);
* ``POST /admin/replicas`` -- register one (``name``, http(s) ``url``, existing ``pool``,
  ``group`` = stable, ``weight`` = 1, ``max_loras`` = 0, and ``kv_events``: ``{endpoint,
  replay_endpoint, topic}`` where it publishes KV-cache events, as in the fleet config); 409 if
  the name exists. It is also
  recorded in the batch tier's store, where workers find it (a replica of a ``shared``, ``batch``
  or ``spot`` pool then takes that lane's batch work as fleet-file replicas do);
* ``PATCH /admin/replicas/{name}`` -- ``healthy`` (false: out of routing at once and its
  in-flight requests fail fast), ``draining`` (no new requests), ``weight`` (canary split);
* ``DELETE /admin/replicas/{name}`` -- drain, then deregister; answers 200 once removed, or 202
  when ``timeout_s`` passed first (removal completes in the background when the last request ends).
  Its store record goes first, so workers send it no new batch lines while it drains;
* ``GET /admin/load`` -- per pool: queue depth, queue wait / TTFT / TPOT p95 over a 5 s window,
  in-flight, KV usage max/mean, scraped waiting, healthy/total replicas, requests/s, error rate;
  per canary group: cumulative ``requests`` and ``errors`` and the windowed ``error_rate``.

With ``TIDAL_REDIS_URL`` set, each change to replicas is also made by every other gateway process
(:class:`~api.shared_state.AdminFeed`), so a call reaches the whole fleet, whichever process
answered it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, UrlConstraints
from sqlmodel import Session

from tidal.api.deps import AdminDep, InteractiveDep, StateDep
from tidal.api.state import GatewayState
from tidal.batch_jobs.store import delete_runtime_replica, put_runtime_replica
from tidal.fleet import KVEventsSpec

__all__ = ["router"]

log = logging.getLogger(__name__)

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
    kv_events: KVEventsSpec | None = None


class ReplicaPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    healthy: bool | None = None
    weight: float | None = Field(default=None, ge=0.0, le=1000.0)
    draining: bool | None = None


@router.get("/replicas", summary="Every replica with its live state")
async def list_replicas(admin: AdminDep, service: InteractiveDep) -> dict[str, Any]:
    return {"data": [service.replica_json(s) for s in service.registry]}


@router.post("/replicas", status_code=201, summary="Register a replica at run time")
async def add_replica(
    body: ReplicaCreate, admin: AdminDep, service: InteractiveDep, gateway: StateDep
) -> dict[str, Any]:
    state = service.add_replica(
        name=body.name,
        url=str(body.url),
        pool=body.pool,
        group=body.group,
        weight=body.weight,
        max_loras=body.max_loras,
        kv_events=body.kv_events,
    )
    await _record(
        gateway,
        lambda s: put_runtime_replica(
            s, name=state.name, pool=state.pool, url=state.url, group=state.group, max_loras=state.max_loras
        ),
    )
    await service.share_admin("register", body.model_dump(mode="json"))
    return service.replica_json(state)


@router.patch("/replicas/{name}", summary="Mark healthy/unhealthy, drain, or set the canary weight")
async def patch_replica(
    name: str, body: ReplicaPatch, admin: AdminDep, service: InteractiveDep
) -> dict[str, Any]:
    state = service.patch_replica(name, healthy=body.healthy, draining=body.draining, weight=body.weight)
    await service.share_admin("patch", {"name": name, **body.model_dump(exclude_none=True)})
    return service.replica_json(state)


@router.delete("/replicas/{name}", summary="Drain, then deregister a replica")
async def delete_replica(
    name: str,
    admin: AdminDep,
    service: InteractiveDep,
    response: Response,
    gateway: StateDep,
    timeout_s: Annotated[float, Query(ge=0, le=600)] = 30.0,
) -> dict[str, Any]:
    # Workers first (also a record left behind by an earlier gateway process), then drain here.
    await _record(gateway, lambda s: delete_runtime_replica(s, name))
    service.replica(name)  # 404 before telling anyone
    await service.share_admin("remove", {"name": name, "timeout_s": timeout_s})
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


async def _record(gateway: GatewayState, change: Callable[[Session], object]) -> None:
    """Apply ``change`` to the batch tier's store; nothing when this gateway runs without one. A
    failed write is logged, not raised: the gateway's own registry has changed either way."""
    if gateway.batch is None:
        return
    store = gateway.batch.store

    def write() -> None:
        with store.session() as s:
            change(s)

    try:
        await run_in_threadpool(write)
    except Exception:
        log.exception("could not record a run-time replica change for the batch workers")
