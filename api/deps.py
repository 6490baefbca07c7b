"""Dependencies as ``Annotated`` aliases, so handlers read as typed parameters.

They are ``async def`` although none of them awaits: FastAPI runs plain ``def`` dependencies in
a worker thread, and that hand-off per request is a large part of a proxied request's cost.

Example::

    @router.get("/v1/things")
    async def list_things(state: StateDep, principal: PrincipalDep) -> ...
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from tidal.api.auth import Principal, bearer_principal
from tidal.api.errors import APIError
from tidal.api.interactive import InteractiveService
from tidal.api.state import GatewayState
from tidal.batch_jobs.jobs import JobService
from tidal.batch_jobs.service import BatchService

__all__ = [
    "AdminDep",
    "BatchDep",
    "InteractiveDep",
    "JobsDep",
    "PrincipalDep",
    "StateDep",
    "get_interactive",
    "get_state",
    "require_admin",
    "require_principal",
]


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.tidal
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


async def require_principal(request: Request, state: StateDep) -> Principal:
    """The caller, from ``Authorization: Bearer <key>``; 401 (OpenAI-shaped) otherwise."""
    return bearer_principal(state.keys, request.headers.get("authorization", ""))


PrincipalDep = Annotated[Principal, Depends(require_principal)]


async def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.admin:
        raise APIError(403, "This endpoint needs an admin key.", code="admin_required")
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]


async def get_interactive(state: StateDep) -> InteractiveService:
    if state.interactive is None:
        raise APIError(503, "The interactive path is not running in this gateway.", code="not_available")
    return state.interactive


InteractiveDep = Annotated[InteractiveService, Depends(get_interactive)]


async def get_batch_service(state: StateDep) -> BatchService:
    if state.batch is None:
        raise APIError(503, "The batch tier is not enabled on this gateway.", code="batch_disabled")
    return state.batch


BatchDep = Annotated[BatchService, Depends(get_batch_service)]


async def get_job_service(state: StateDep) -> JobService:
    if state.jobs is None:
        raise APIError(503, "The batch tier is not enabled on this gateway.", code="batch_disabled")
    return state.jobs


JobsDep = Annotated[JobService, Depends(get_job_service)]
