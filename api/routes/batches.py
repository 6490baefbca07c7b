"""OpenAI Batches: create, retrieve, list, cancel.

Tidal's extensions ride in ``metadata`` (OpenAI allows 16 string pairs): ``priority`` "0".."9"
(9 most urgent), ``lane`` ``reserved``/``spot``/``any``, ``deadline`` (Unix seconds), ``feature``
(a feature the key may use; its ``regions`` bound where the lines run).

Example (the official SDK, unchanged)::

    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"priority": "9", "lane": "spot"})
    client.batches.retrieve(b.id).request_counts
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from tidal.api.batch_tier import batch_errors
from tidal.api.deps import BatchDep, PrincipalDep
from tidal.batch_jobs.models import BatchCreate, BatchPublic, ListPage

__all__ = ["router"]

router = APIRouter(tags=["batches"])


@router.post("/v1/batches", summary="Create a batch from an uploaded JSONL file")
async def create_batch(body: BatchCreate, principal: PrincipalDep, svc: BatchDep) -> BatchPublic:
    with batch_errors():
        batch = await run_in_threadpool(
            svc.create_batch,
            principal.tenant,
            body,
            admin=principal.admin,
            features=principal.features,
            default_feature=principal.default_feature,
        )
    return await run_in_threadpool(svc.public_batch, batch)


@router.get("/v1/batches", summary="List your batches, newest first")
async def list_batches(
    principal: PrincipalDep,
    svc: BatchDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage:
    with batch_errors():
        return await run_in_threadpool(svc.list_batches, principal.tenant, after=after, limit=limit)


@router.get("/v1/batches/{batch_id}", summary="A batch with its live request_counts")
async def retrieve_batch(batch_id: str, principal: PrincipalDep, svc: BatchDep) -> BatchPublic:
    with batch_errors():
        batch = await run_in_threadpool(svc.get_batch, principal.tenant, batch_id)
    return await run_in_threadpool(svc.public_batch, batch)


@router.post("/v1/batches/{batch_id}/cancel", summary="Cancel a batch (partial results are kept)")
async def cancel_batch(batch_id: str, principal: PrincipalDep, svc: BatchDep) -> BatchPublic:
    with batch_errors():
        batch = await run_in_threadpool(svc.cancel_batch, principal.tenant, batch_id)
    return await run_in_threadpool(svc.public_batch, batch)
