"""Jobs: offline evals, embedding backfills and summaries, each compiled into batches.

Example::

    curl -H "Authorization: Bearer $KEY" -d '{"kind": "eval", "input_file_id": "file-...",
         "model": "llama-3.1-8b-instruct", "options": {"scorer": "contains"}}' $URL/v1/jobs
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from tidal.api.batch_tier import batch_errors
from tidal.api.deps import JobsDep, PrincipalDep
from tidal.batch_jobs.models import JobCreate, JobPublic, ListPage

__all__ = ["router"]

router = APIRouter(tags=["jobs"])


@router.post("/v1/jobs", summary="Start a job (eval, embedding_backfill, summaries) on a dataset file")
async def create_job(body: JobCreate, principal: PrincipalDep, jobs: JobsDep) -> JobPublic:
    with batch_errors():
        job = await run_in_threadpool(
            jobs.create_job,
            principal.tenant,
            body,
            admin=principal.admin,
            features=principal.features,
            default_feature=principal.default_feature,
        )
        return await run_in_threadpool(jobs.public_job, job)


@router.get("/v1/jobs", summary="List your jobs, newest first")
async def list_jobs(
    principal: PrincipalDep,
    jobs: JobsDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage:
    with batch_errors():
        return await run_in_threadpool(jobs.list_jobs, principal.tenant, after=after, limit=limit)


@router.get("/v1/jobs/{job_id}", summary="A job: status, current batch progress, result and output files")
async def retrieve_job(job_id: str, principal: PrincipalDep, jobs: JobsDep) -> JobPublic:
    with batch_errors():
        job = await run_in_threadpool(jobs.get_job, principal.tenant, job_id)
        return await run_in_threadpool(jobs.public_job, job)


@router.post("/v1/jobs/{job_id}/cancel", summary="Cancel a job's current batch")
async def cancel_job(job_id: str, principal: PrincipalDep, jobs: JobsDep) -> JobPublic:
    with batch_errors():
        job = await run_in_threadpool(jobs.cancel_job, principal.tenant, job_id)
        return await run_in_threadpool(jobs.public_job, job)
