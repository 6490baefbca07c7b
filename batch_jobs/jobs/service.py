"""Jobs: a kind compiles its dataset into batches (one per stage); when a stage's batch is final,
the next stage starts or the kind writes its outputs.

Example::

    jobs = JobService(batch_service)
    job = jobs.create_job("acme", JobCreate(kind="eval", input_file_id=f.id, model="tiny",
                                            options={"scorer": "contains"}))
    jobs.public_job(jobs.get_job("acme", job.id)).result     # {"score": 0.9, "ci95": [...], ...}
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Set
from typing import Any

from sqlmodel import col, select

from tidal.batch_jobs import queries
from tidal.batch_jobs.errors import Conflict, Forbidden, InvalidRequest, NotFound
from tidal.batch_jobs.files import StoredFile, new_id
from tidal.batch_jobs.jobs.base import Answer, Finished, JobContext, JobKind, JobOptions, Stage
from tidal.batch_jobs.jobs.embedding_backfill import EmbeddingBackfill
from tidal.batch_jobs.jobs.offline_eval import OfflineEval
from tidal.batch_jobs.jobs.summaries import SummariesKind
from tidal.batch_jobs.models import (
    BATCH_TERMINAL,
    BatchCreate,
    BatchRecord,
    JobCreate,
    JobPublic,
    JobRecord,
    ListPage,
)
from tidal.batch_jobs.service import DATASET_PURPOSES, BatchService
from tidal.fleet import EMBEDDINGS_ENDPOINT

__all__ = ["KINDS", "JobService"]

log = logging.getLogger(__name__)

KINDS: dict[str, JobKind] = {k.name: k for k in (OfflineEval(), EmbeddingBackfill(), SummariesKind())}
STALE_CLAIM_S = 300.0


class JobService:
    """Creates jobs, advances them stage by stage, and answers for them per tenant."""

    def __init__(self, batch: BatchService) -> None:
        self.batch = batch
        self.store = batch.store

    # -- creating -------------------------------------------------------------------------------

    def _context_cap(self, model: str) -> int:
        fleet = self.batch.fleet
        adapter = fleet.adapter(model)
        base = fleet.model(adapter.base_model if adapter else model)
        feature = fleet.features.get("batch")
        return min(base.max_model_len, feature.context_cap if feature else base.max_model_len)

    def create_job(
        self,
        tenant: str,
        params: JobCreate,
        *,
        admin: bool = False,
        features: Set[str] = frozenset({"*"}),
        default_feature: str | None = None,
    ) -> JobRecord:
        """Validate the dataset and options, then start the first stage's batch.

        The job's feature (``options.feature``, resolved as a batch's from the key's ``features``
        and ``default_feature``) is kept in its options: every stage's batch runs under it.
        """
        kind = KINDS[params.kind]
        options = kind.parse_options(params.options)
        feature = self.batch.resolve_feature(
            options.feature, features, default_feature, param="options.feature"
        )
        options = options.model_copy(update={"feature": feature})
        served = self.batch.served_models(tenant, kind.endpoint)
        if params.model not in served:
            if params.model in self.batch.served_models(tenant):
                what = (
                    "embedding model" if kind.endpoint == EMBEDDINGS_ENDPOINT else "chat or completion model"
                )
                raise InvalidRequest(
                    f"model {params.model!r} cannot run {kind.name} jobs: they need an {what} "
                    f"(one that serves {kind.endpoint}); served for them: {', '.join(sorted(served)) or 'none'}",
                    param="model",
                    code="model_not_supported",
                )
            raise InvalidRequest(
                f"model {params.model!r} is not served here", param="model", code="model_not_found"
            )
        kind.check_options(options, served_models=served)
        if (options.pool or options.replica_group) and not admin:
            raise Forbidden("only admins may pin a job to a pool or replica group", param="options.pool")
        f = self.batch.get_file(tenant, params.input_file_id, param="input_file_id")
        if f.purpose not in DATASET_PURPOSES:
            raise InvalidRequest(
                f"job datasets are uploaded with purpose {' or '.join(DATASET_PURPOSES)} (this file has {f.purpose!r})",
                param="input_file_id",
                code="invalid_purpose",
            )
        job = JobRecord(
            id=new_id("job_"),
            tenant=tenant,
            kind=kind.name,
            model=params.model,
            input_file_id=f.id,
            created_at=int(self.batch.clock.now()),
            options_json=options.model_dump_json(),
            metadata_json=json.dumps(params.metadata) if params.metadata else None,
        )
        ctx = self._context(job, state={})
        stage = kind.start(ctx)
        batch = self._launch(job, options, stage, stage_no=0)
        job.batch_id = batch.id
        job.batch_ids_json = json.dumps([batch.id])
        job.state_json = json.dumps(ctx.state)
        if batch.status == "failed":
            job.status = "failed"
            job.error = _batch_errors(batch)
        with self.store.session() as s:
            s.add(job)
        return job

    def _context(self, job: JobRecord, *, state: dict[str, Any]) -> JobContext:
        kind = KINDS[job.kind]
        f = self.batch.get_file(job.tenant, job.input_file_id)
        return JobContext(
            job_id=job.id,
            model=job.model,
            options=kind.Options.model_validate_json(job.options_json),
            dataset=StoredFile(self.batch.files, f.path),
            state=state,
            context_cap=self._context_cap(job.model),
            max_items=self.batch.settings.max_batch_lines,
        )

    def _launch(self, job: JobRecord, options: JobOptions, stage: Stage, *, stage_no: int) -> BatchRecord:
        lines = (
            json.dumps(
                {"custom_id": ln["custom_id"], "method": "POST", "url": stage.endpoint, "body": ln["body"]}
            )
            + "\n"
            for ln in stage.lines
        )
        f = self.batch.save_generated_file(
            job.tenant, filename=f"{job.id}_stage{stage_no}.jsonl", purpose="batch", lines=lines
        )
        metadata = {"priority": str(options.priority), "lane": options.lane, "job": job.id}
        if options.feature:
            metadata["feature"] = options.feature
        if options.pool:
            metadata["pool"] = options.pool
        if options.replica_group:
            metadata["replica_group"] = options.replica_group
        params = BatchCreate(
            input_file_id=f.id, endpoint=stage.endpoint, completion_window="24h", metadata=metadata
        )
        # Pool pinning and the feature were checked against the caller in create_job, and the
        # tenant's max_lines_queued with its first stage: a job accepted is not failed for it later.
        only = frozenset({options.feature}) if options.feature else frozenset()
        return self.batch.create_batch(
            job.tenant,
            params,
            admin=True,
            job_id=job.id,
            features=only,
            default_feature=options.feature,
            check_queued_limit=stage_no == 0,
        )

    # -- advancing ------------------------------------------------------------------------------

    def after_final(self, batch: BatchRecord) -> None:
        """Called by the batch finaliser: start the job's next stage or write its outputs."""
        if not batch.job_id:
            return
        token = secrets.token_hex(8)
        with self.store.session() as s:
            won = queries.claim_job_advance(
                s, job_id=batch.job_id, batch_id=batch.id, claim=f"{token}@{time.time():.0f}"
            )
        if won != 1:
            return
        try:
            self._advance(batch)
        except Exception as exc:
            log.exception("job %s failed while advancing", batch.job_id)
            self._finish(
                batch.job_id, status="failed", error=f"internal error while advancing: {exc!r}"[:1000]
            )

    def _advance(self, batch: BatchRecord) -> None:
        assert batch.job_id is not None
        with self.store.session() as s:
            job = s.exec(select(JobRecord).where(JobRecord.id == batch.job_id)).one()
        if batch.status != "completed":
            status = {"cancelled": "cancelled", "expired": "expired"}.get(batch.status, "failed")
            self._finish(
                job.id, status=status, error=f"stage {job.stage} batch {batch.id} ended {batch.status}"
            )
            return
        kind = KINDS[job.kind]
        ctx = self._context(job, state=json.loads(job.state_json or "{}"))
        out = kind.advance(ctx, self._answers(batch.id))
        if isinstance(out, Stage):
            nxt = self._launch(job, ctx.options, out, stage_no=job.stage + 1)
            with self.store.session() as s:
                row = s.exec(select(JobRecord).where(JobRecord.id == job.id)).one()
                row.stage += 1
                row.batch_id = nxt.id
                row.batch_ids_json = json.dumps([*json.loads(row.batch_ids_json), nxt.id])
                row.state_json = json.dumps(ctx.state)
                row.advance_claim = None
                if nxt.status == "failed":
                    row.status, row.error = "failed", _batch_errors(nxt)
                    row.completed_at = int(self.batch.clock.now())
                s.add(row)
            return
        self._write_outputs(job, out)

    def _write_outputs(self, job: JobRecord, out: Finished) -> None:
        ids: dict[str, str] = {}
        for name, output in out.outputs.items():
            f = self.batch.save_generated_file(
                job.tenant, filename=output.filename, purpose="batch_output", lines=[output.content]
            )
            ids[name] = f.id
        with self.store.session() as s:
            row = s.exec(select(JobRecord).where(JobRecord.id == job.id)).one()
            row.result_json = json.dumps(out.result)
            row.output_file_ids_json = json.dumps(ids)
            row.status = "completed"
            row.completed_at = int(self.batch.clock.now())
            row.advance_claim = None
            s.add(row)

    def _finish(self, job_id: str, *, status: str, error: str) -> None:
        with self.store.session() as s:
            row = s.exec(select(JobRecord).where(JobRecord.id == job_id)).one()
            row.status, row.error = status, error
            row.completed_at = int(self.batch.clock.now())
            row.advance_claim = None
            s.add(row)

    def _answers(self, batch_id: str) -> dict[str, Answer]:
        out: dict[str, Answer] = {}
        with self.store.session() as s:
            rows = queries.batch_answers(s, batch_id)
            for cid, state, body, err in rows:
                parsed = _loads(body)
                message = None
                if state != "done":
                    e = _loads(err) or (parsed or {}).get("error") or {}
                    message = str(e.get("message") if isinstance(e, dict) else e)[:500]
                out[cid] = Answer(cid, state == "done", parsed, message)
        return out

    def advance_stuck(self) -> int:
        """Sweep step: jobs whose current batch is final but were never advanced (a crash)."""
        cutoff = time.time() - STALE_CLAIM_S
        with self.store.session() as s:
            rows = queries.stuck_jobs(s)
        n = 0
        for job_id, claim, batch_id in rows:
            if claim:
                claimed_at = float(claim.rsplit("@", 1)[-1])
                if claimed_at > cutoff:
                    continue
                with self.store.session() as s:
                    queries.release_job_claim(s, job_id=job_id, claim=claim)
            with self.store.session() as s:
                batch = s.exec(select(BatchRecord).where(BatchRecord.id == batch_id)).one()
            self.after_final(batch)
            n += 1
        return n

    # -- reading --------------------------------------------------------------------------------

    def get_job(self, tenant: str, job_id: str) -> JobRecord:
        with self.store.session() as s:
            job = s.exec(select(JobRecord).where(JobRecord.id == job_id, JobRecord.tenant == tenant)).first()
        if job is None:
            raise NotFound(f"No such job: {job_id[:64]!r}", param="job_id")
        return job

    def public_job(self, job: JobRecord) -> JobPublic:
        current = None
        if job.batch_id:
            b = self.batch.get_batch(job.tenant, job.batch_id)
            pub = self.batch.public_batch(b)
            current = {"id": b.id, "status": b.status, "request_counts": pub.request_counts.model_dump()}
        return JobPublic(
            id=job.id,
            kind=job.kind,
            model=job.model,
            input_file_id=job.input_file_id,
            status=job.status,
            stage=job.stage,
            created_at=job.created_at,
            completed_at=job.completed_at,
            batch_ids=json.loads(job.batch_ids_json),
            current_batch=current,
            result=json.loads(job.result_json) if job.result_json else None,
            output_file_ids=json.loads(job.output_file_ids_json),
            error=job.error,
            metadata=json.loads(job.metadata_json) if job.metadata_json else None,
        )

    def list_jobs(self, tenant: str, *, after: str | None = None, limit: int = 20) -> ListPage:
        with self.store.session() as s:
            q = select(JobRecord).where(JobRecord.tenant == tenant)
            if after:
                anchor = s.exec(
                    select(JobRecord.seq).where(JobRecord.id == after, JobRecord.tenant == tenant)
                ).first()
                if anchor is None:
                    raise NotFound(f"No such job: {after[:64]!r}", param="after")
                q = q.where(col(JobRecord.seq) < anchor)
            rows = list(s.exec(q.order_by(col(JobRecord.seq).desc()).limit(limit + 1)).all())
        page = [self.public_job(j) for j in rows[:limit]]
        return ListPage(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(rows) > limit,
        )

    def cancel_job(self, tenant: str, job_id: str) -> JobRecord:
        job = self.get_job(tenant, job_id)
        if job.status != "in_progress":
            raise Conflict(f"Cannot cancel a job with status {job.status!r}.", code="job_not_cancellable")
        if job.batch_id:
            b = self.batch.get_batch(tenant, job.batch_id)
            if b.status not in BATCH_TERMINAL and b.status != "cancelling":
                self.batch.cancel_batch(tenant, b.id)
        return self.get_job(tenant, job_id)


def _loads(raw: str | None) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _batch_errors(batch: BatchRecord) -> str:
    errors = json.loads(batch.errors_json or "[]")
    shown = "; ".join(str(e.get("message")) for e in errors[:5])
    return f"stage batch {batch.id} failed validation: {shown}"[:1000]
