"""The batch tier's services behind the gateway's Files and Batches routes: handlers orchestrate,
these decide.

Example::

    svc = BatchService.from_settings(fleet, settings)
    f = await svc.upload_file("acme", filename="in.jsonl", purpose="batch", chunks=stream)
    b = svc.create_batch("acme", BatchCreate(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h", metadata={"priority": "9"}))
    svc.public_batch(b).request_counts
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Set
from typing import Any, BinaryIO

from sqlalchemy import insert
from sqlmodel import Session, col, func, select

from tidal.batch_jobs import queries
from tidal.batch_jobs.dispatch import ChunkPublisher, tenant_windows, top_up
from tidal.batch_jobs.errors import Conflict, Forbidden, InvalidRequest, LimitExceeded, NotFound, TooLarge
from tidal.batch_jobs.files import (
    FileStore,
    FileTooLarge,
    Readable,
    StoredFile,
    file_store_from_settings,
    new_id,
    safe_filename,
)
from tidal.batch_jobs.models import (
    BATCH_ACTIVE,
    BATCH_TERMINAL,
    BatchChunk,
    BatchCreate,
    BatchLine,
    BatchPublic,
    BatchRecord,
    FilePublic,
    FileRecord,
    ListPage,
    RequestCounts,
)
from tidal.batch_jobs.store import Store, line_counts
from tidal.batch_jobs.validation import SUPPORTED_ENDPOINTS, iter_valid_lines, validate_batch_file
from tidal.clock import Clock, WallClock
from tidal.fleet import FleetConfig, PoolSpec
from tidal.priority.classes import BATCH_PRIORITY_MAX, lane_pools
from tidal.priority.features import PlanError, resolve_batch_feature
from tidal.priority.queues import LANE_PREFERENCES, LANES, lane_for_preference
from tidal.settings import Settings

__all__ = ["BATCH_PURPOSE", "DATASET_PURPOSES", "UPLOAD_PURPOSES", "BatchService"]

BATCH_PURPOSE = "batch"
# Job datasets (eval prompts, documents to summarise, items to embed) use OpenAI's data purposes.
DATASET_PURPOSES = ("user_data", "evals")
UPLOAD_PURPOSES = (BATCH_PURPOSE, *DATASET_PURPOSES)
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_PAIRS = 16
_INSERT_PAGE = 1000


class BatchService:
    """Files, batches and their validation, planning and publishing, for one store."""

    def __init__(
        self,
        *,
        store: Store,
        files: FileStore,
        fleet: FleetConfig,
        settings: Settings,
        publisher: ChunkPublisher | None,
        clock: Clock | None = None,
        max_active_batches_per_tenant: int = 200,
    ) -> None:
        self.store = store
        self.files = files
        self.fleet = fleet
        self.settings = settings
        self.publisher = publisher
        self.clock: Clock = clock or WallClock()
        self.max_active_batches_per_tenant = max_active_batches_per_tenant
        # Each tenant's share of a lane's queue (see batch_jobs.dispatch.top_up).
        self.windows = tenant_windows(fleet, settings)

    @classmethod
    def from_settings(
        cls, fleet: FleetConfig, settings: Settings, *, publisher: ChunkPublisher | None = None
    ) -> BatchService:
        store = Store.from_url(settings.resolved_database_url)
        files = file_store_from_settings(settings)
        return cls(store=store, files=files, fleet=fleet, settings=settings, publisher=publisher)

    def served_models(self, tenant: str, endpoint: str | None = None) -> set[str]:
        """The models and adapters ``tenant``'s lines may name (adapters bound to others are not);
        with ``endpoint``, those of them that can answer it."""
        return self.fleet.served_models(tenant, endpoint)

    def resolve_feature(
        self, named: str | None, features: Set[str], default_feature: str | None, *, param: str
    ) -> str | None:
        """A batch's (or job's) feature, as :func:`~priority.features.resolve_batch_feature` says."""
        try:
            return resolve_batch_feature(self.fleet, named, features, default_feature, param=param)
        except PlanError as exc:
            error = Forbidden if exc.status == 403 else InvalidRequest
            raise error(exc.message, param=exc.param, code=exc.code) from None

    def _now(self) -> int:
        return int(self.clock.now())

    # -- files ------------------------------------------------------------------------------------

    async def upload_file(
        self,
        tenant: str,
        *,
        filename: str | None,
        purpose: str,
        chunks: AsyncIterator[bytes],
        expires_after_s: int | None = None,
    ) -> FileRecord:
        """Store an upload (size-limited while it arrives); nothing is kept if it is refused."""
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(
                f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose[:40]!r}", param="purpose"
            )
        if expires_after_s is not None and not 3600 <= expires_after_s <= 2_592_000:
            raise InvalidRequest(
                "expires_after[seconds] must be between 3600 and 2592000", param="expires_after"
            )
        file_id = new_id("file-")
        try:
            rel, size = await self.files.save_stream(tenant, file_id, chunks)
        except FileTooLarge as exc:
            raise TooLarge(f"The file is larger than the limit of {exc.limit} bytes.", param="file") from None
        if size == 0:
            self.files.delete(rel)
            raise InvalidRequest("The file is empty.", param="file", code="empty_file")
        now = self._now()
        rec = FileRecord(
            id=file_id,
            tenant=tenant,
            purpose=purpose,
            filename=safe_filename(filename),
            bytes=size,
            created_at=now,
            expires_at=now + expires_after_s if expires_after_s else None,
            path=rel,
        )
        with self.store.session() as s:
            s.add(rec)
        return rec

    def save_generated_file(
        self, tenant: str, *, filename: str, purpose: str, lines: Iterable[bytes | str]
    ) -> FileRecord:
        """A file the platform writes itself (job inputs, reports)."""
        file_id = new_id("file-")
        rel, size = self.files.save_lines(tenant, file_id, lines)
        rec = FileRecord(
            id=file_id,
            tenant=tenant,
            purpose=purpose,
            filename=safe_filename(filename),
            bytes=size,
            created_at=self._now(),
            path=rel,
        )
        with self.store.session() as s:
            s.add(rec)
        return rec

    def get_file(self, tenant: str, file_id: str, *, param: str = "file_id") -> FileRecord:
        with self.store.session() as s:
            f = s.exec(
                select(FileRecord).where(FileRecord.id == file_id, FileRecord.tenant == tenant)
            ).first()
        if f is None:
            raise NotFound(f"No such file: {file_id[:64]!r}", param=param)
        return f

    def open_file(self, tenant: str, file_id: str) -> BinaryIO:
        """A tenant's file for a streaming read (close it after)."""
        return self.files.open(self.get_file(tenant, file_id).path)

    def list_files(
        self,
        tenant: str,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
    ) -> ListPage:
        with self.store.session() as s:
            q = select(FileRecord).where(FileRecord.tenant == tenant)
            if purpose:
                q = q.where(FileRecord.purpose == purpose)
            if after:
                anchor = s.exec(
                    select(FileRecord.seq).where(FileRecord.id == after, FileRecord.tenant == tenant)
                ).first()
                if anchor is None:
                    raise NotFound(f"No such file: {after[:64]!r}", param="after")
                q = q.where(col(FileRecord.seq) < anchor if order == "desc" else col(FileRecord.seq) > anchor)
            q = q.order_by(col(FileRecord.seq).desc() if order == "desc" else col(FileRecord.seq)).limit(
                limit + 1
            )
            rows = list(s.exec(q).all())
        page = [FilePublic.of(f) for f in rows[:limit]]
        return ListPage(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(rows) > limit,
        )

    def delete_file(self, tenant: str, file_id: str) -> None:
        f = self.get_file(tenant, file_id)
        with self.store.session() as s:
            queries.delete_file_record(s, file_id=f.id, tenant=tenant)
        self.files.delete(f.path)

    # -- batches ----------------------------------------------------------------------------------

    def create_batch(
        self,
        tenant: str,
        params: BatchCreate,
        *,
        admin: bool = False,
        job_id: str | None = None,
        features: Set[str] = frozenset({"*"}),
        default_feature: str | None = None,
        check_queued_limit: bool = True,
    ) -> BatchRecord:
        """Validate, plan and publish a batch. Request-level problems raise (nothing is created);
        problems inside the file give a ``failed`` batch whose ``errors`` name every bad line.

        ``features`` are those the caller's key may use and ``default_feature`` its only one: they
        decide the batch's feature (``metadata.feature``), whose ``regions`` its lines stay in.
        A batch that would take the tenant past its ``batch.max_lines_queued`` is refused (429);
        ``check_queued_limit=False`` is for the later stages of a job already accepted, which
        must not fail for it. Only the tenant's window of chunks is published at once; the rest
        follow as chunks finish (:func:`~batch_jobs.dispatch.top_up`).
        """
        if params.endpoint not in SUPPORTED_ENDPOINTS:
            raise InvalidRequest(
                f"endpoint must be one of {', '.join(SUPPORTED_ENDPOINTS)}; got {params.endpoint[:64]!r}",
                param="endpoint",
                code="unsupported_endpoint",
            )
        window = COMPLETION_WINDOWS.get(params.completion_window)
        if window is None:
            raise InvalidRequest(
                f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}", param="completion_window"
            )
        ext = self._extensions(params.metadata, admin=admin)
        feature = self.resolve_feature(
            (params.metadata or {}).get("feature"), features, default_feature, param="metadata.feature"
        )
        spec = self.fleet.features[feature] if feature is not None else None
        regions = frozenset(spec.regions) if spec is not None and spec.regions is not None else None
        f = self.get_file(tenant, params.input_file_id, param="input_file_id")
        if f.purpose != BATCH_PURPOSE:
            raise InvalidRequest(
                f"The input file must be uploaded with purpose 'batch' (it has {f.purpose!r}).",
                param="input_file_id",
                code="invalid_purpose",
            )
        with self.store.session() as s:
            active = s.exec(
                select(func.count())
                .select_from(BatchRecord)
                .where(BatchRecord.tenant == tenant, col(BatchRecord.status).in_(list(BATCH_ACTIVE)))
            ).one()
        if int(active) >= self.max_active_batches_per_tenant:
            raise LimitExceeded(
                f"Too many unfinished batches ({active}); wait for some to finish.", code="too_many_batches"
            )
        now = self._now()
        expires_at = now + window
        if ext["deadline"] is not None:
            expires_at = min(expires_at, ext["deadline"])
        batch = BatchRecord(
            id=new_id("batch_"),
            tenant=tenant,
            endpoint=params.endpoint,
            input_file_id=f.id,
            completion_window=params.completion_window,
            status="validating",
            priority=ext["priority"],
            lane=ext["lane"],
            queue_lane=lane_for_preference(ext["lane"]).value,
            pool=ext["pool"],
            replica_group=ext["replica_group"],
            feature=feature,
            regions_json=json.dumps(sorted(regions)) if regions is not None else None,
            job_id=job_id,
            created_at=now,
            expires_at=expires_at,
            metadata_json=json.dumps(params.metadata) if params.metadata else None,
        )
        source = StoredFile(self.files, f.path)
        served = self.served_models(tenant, params.endpoint)
        report = validate_batch_file(
            source,
            endpoint=params.endpoint,
            models=served,
            max_lines=self.settings.max_batch_lines,
            other_kind=self.served_models(tenant) - served,
        )
        limit = self._queued_limit(tenant) if check_queued_limit else None
        if limit is not None and not report.error_count:
            # A first look before writing anything; decided again under the tenant's lock below.
            with self.store.session() as s:
                self._check_queued(s, tenant, batch.id, report.lines, limit)
        if report.error_count:
            batch.status = "failed"
            batch.failed_at = now
            batch.errors_json = json.dumps([e.model_dump() for e in report.finish()])
            with self.store.session() as s:
                s.add(batch)
            return batch
        if regions is not None:
            assert feature is not None
            batch.queue_lane = self._resident_lane(batch, feature, regions, report.models)
        batch.model = next(iter(report.models)) if len(report.models) == 1 else None
        with self.store.session() as s:
            s.add(batch)
            s.flush()
            total = self._insert_lines(s, batch, source)
            if limit is not None:
                # Two submissions of the tenant racing: the second sees the first, or waits for it.
                queries.lock_tenant(s, tenant)
                self._check_queued(s, tenant, batch.id, total, limit)
            batch.total = total
            batch.status = "in_progress"
            batch.in_progress_at = now
            s.add(batch)
        if self.publisher is not None:
            top_up(self.store, self.publisher, self.windows, tenant=tenant, lane=batch.queue_lane)
        return batch

    def _queued_limit(self, tenant: str) -> int | None:
        spec = self.fleet.tenant(tenant)
        return spec.batch.max_lines_queued if spec is not None else None

    def _check_queued(self, s: Session, tenant: str, batch_id: str, lines: int, limit: int) -> None:
        """Refuse a batch of ``lines`` that would take ``tenant``'s unfinished batches past
        ``limit`` lines: at submission, never accepted and failed later."""
        queued = queries.queued_lines(s, tenant, exclude_batch_id=batch_id)
        if queued + lines <= limit:
            return
        advice = (
            f" A batch of more than {limit} lines is never accepted: split it."
            if lines > limit
            else " Wait for some of them to finish (or cancel one), then submit again."
        )
        raise LimitExceeded(
            f"This batch has {lines} lines and your unfinished batches already hold {queued}: "
            f"together {queued + lines}, past your limit of {limit} queued lines "
            f"(max_lines_queued).{advice}",
            code="max_lines_queued_exceeded",
        )

    def _insert_lines(self, s: Session, batch: BatchRecord, source: Readable) -> int:
        size = self.settings.chunk_lines
        conn = s.connection()
        page: list[dict[str, Any]] = []
        n = 0
        for line in iter_valid_lines(
            source, endpoint=batch.endpoint, models=self.served_models(batch.tenant, batch.endpoint)
        ):
            page.append(
                {
                    "batch_id": batch.id,
                    "line_no": line.line_no,
                    "custom_id": line.custom_id,
                    "chunk_no": n // size,
                    "body": json.dumps(line.body, separators=(",", ":")),
                    "state": "pending",
                    "input_tokens": 0,
                    "output_tokens": 0,
                    "cached_tokens": 0,
                }
            )
            n += 1
            if len(page) >= _INSERT_PAGE:
                conn.execute(insert(BatchLine), page)
                page = []
        if page:
            conn.execute(insert(BatchLine), page)
        chunks = []
        line_nos = queries.chunk_spans(s, batch.id)
        for chunk_no, first, last in line_nos:
            chunks.append(
                {
                    "batch_id": batch.id,
                    "chunk_no": chunk_no,
                    "queue_lane": batch.queue_lane,
                    "priority": batch.priority,
                    "first_line": first,
                    "last_line": last,
                    "state": "pending",
                    "deliveries": 0,
                    "releases": 0,
                    "created_at": self.clock.now(),
                }
            )
        if chunks:
            conn.execute(insert(BatchChunk), chunks)
        return n

    def _resident_lane(
        self, batch: BatchRecord, feature: str, regions: frozenset[str], models: set[str]
    ) -> str:
        """The queue lane of a batch whose lines must stay in ``regions``: 400 when no pool there
        can serve every model it names on its lane. A batch of lane ``any`` goes to the first lane
        that can when some lane of the fleet cannot (its workers would only hand the chunks back)."""

        def inside(pools: list[PoolSpec]) -> list[PoolSpec]:
            return [p for p in pools if p.region is not None and p.region in regions]

        bases = set()
        for m in models:
            adapter = self.fleet.adapter(m)
            bases.add(adapter.base_model if adapter else m)
        where = f"in the regions of the feature '{feature}' ({', '.join(sorted(regions))})"
        if batch.pool is not None:
            pool = self.fleet.pools[batch.pool]
            if not inside([pool]):
                raise InvalidRequest(
                    f"metadata.pool: the pool '{pool.name}' is not {where}.",
                    param="metadata.pool",
                    code="region_not_allowed",
                )
            return batch.queue_lane
        present = [lane for lane in LANES if lane_pools(self.fleet, lane)]
        if batch.lane == "any":
            candidates = list(LANES)
        else:
            lane = lane_for_preference(batch.lane)
            # Without pools of that lane only a worker of lane ``all`` runs it, on another lane's.
            candidates = [lane] if lane in present else list(LANES)
        able = [
            lane
            for lane in candidates
            if all(any(p.model == b for p in inside(lane_pools(self.fleet, lane))) for b in bases)
        ]
        if not able:
            raise InvalidRequest(
                f"No pool {where} can serve the model {', '.join(repr(b) for b in sorted(bases))} "
                f"for a batch of lane '{batch.lane}'.",
                param="metadata.feature",
                code="no_pool_in_region",
            )
        if batch.lane != "any" or all(lane in able for lane in present):
            return batch.queue_lane
        return able[0].value

    def _extensions(self, metadata: dict[str, str] | None, *, admin: bool) -> dict[str, Any]:
        md = metadata or {}
        if len(md) > MAX_METADATA_PAIRS:
            raise InvalidRequest(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs", param="metadata")
        for k, v in md.items():
            if len(k) > 64 or len(v) > 512:
                raise InvalidRequest(
                    "metadata keys are at most 64 and values 512 characters", param="metadata"
                )
        out: dict[str, Any] = {
            "priority": 0,
            "lane": "any",
            "deadline": None,
            "pool": None,
            "replica_group": None,
        }
        if "priority" in md:
            p = md["priority"].strip()
            if not (p.isdigit() and 0 <= int(p) <= BATCH_PRIORITY_MAX):
                raise InvalidRequest(
                    f"metadata.priority must be an integer from 0 to {BATCH_PRIORITY_MAX} (9 is most urgent)",
                    param="metadata.priority",
                )
            out["priority"] = int(p)
        if "lane" in md:
            if md["lane"] not in LANE_PREFERENCES:
                raise InvalidRequest(
                    f"metadata.lane must be one of {', '.join(LANE_PREFERENCES)}", param="metadata.lane"
                )
            out["lane"] = md["lane"]
        if "deadline" in md:
            try:
                deadline = int(float(md["deadline"]))
            except ValueError:
                raise InvalidRequest(
                    "metadata.deadline must be Unix seconds", param="metadata.deadline"
                ) from None
            if deadline <= self._now():
                raise InvalidRequest("metadata.deadline is in the past", param="metadata.deadline")
            out["deadline"] = deadline
        for key in ("pool", "replica_group"):
            if key in md:
                if not admin:
                    raise Forbidden(f"only admins may pin metadata.{key}", param=f"metadata.{key}")
                out[key] = md[key]
        if out["pool"] is not None and out["pool"] not in self.fleet.pools:
            raise InvalidRequest(
                f"metadata.pool: unknown pool {out['pool']!r} (known: {', '.join(sorted(self.fleet.pools))})",
                param="metadata.pool",
            )
        if out["replica_group"] is not None:
            groups = {r.group for p in self.fleet.pools.values() for r in p.replicas}
            if out["replica_group"] not in groups:
                raise InvalidRequest(
                    f"metadata.replica_group: unknown group {out['replica_group']!r}",
                    param="metadata.replica_group",
                )
        return out

    def get_batch(self, tenant: str, batch_id: str) -> BatchRecord:
        with self.store.session() as s:
            b = s.exec(
                select(BatchRecord).where(BatchRecord.id == batch_id, BatchRecord.tenant == tenant)
            ).first()
        if b is None:
            raise NotFound(f"No such batch: {batch_id[:64]!r}", param="batch_id")
        return b

    def public_batch(self, b: BatchRecord) -> BatchPublic:
        if b.status in BATCH_TERMINAL:
            counts = RequestCounts(total=b.total, completed=b.completed, failed=b.failed)
        else:
            with self.store.session() as s:
                counts = line_counts(s, b.id)
        return BatchPublic.of(b, counts)

    def list_batches(self, tenant: str, *, after: str | None = None, limit: int = 20) -> ListPage:
        with self.store.session() as s:
            q = select(BatchRecord).where(BatchRecord.tenant == tenant)
            if after:
                anchor = s.exec(
                    select(BatchRecord.seq).where(BatchRecord.id == after, BatchRecord.tenant == tenant)
                ).first()
                if anchor is None:
                    raise NotFound(f"No such batch: {after[:64]!r}", param="after")
                q = q.where(col(BatchRecord.seq) < anchor)
            rows = list(s.exec(q.order_by(col(BatchRecord.seq).desc()).limit(limit + 1)).all())
        page = [self.public_batch(b) for b in rows[:limit]]
        return ListPage(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(rows) > limit,
        )

    def cancel_batch(self, tenant: str, batch_id: str) -> BatchRecord:
        """``cancelling`` now; the maintenance sweep finalises it as ``cancelled`` with partial
        results once running chunks can no longer write."""
        b = self.get_batch(tenant, batch_id)
        if b.status in ("cancelling", "cancelled"):
            return b
        with self.store.session() as s:
            n = queries.mark_cancelling(s, batch_id=b.id, tenant=tenant, now=self._now())
        if n != 1:
            b = self.get_batch(tenant, batch_id)
            raise Conflict(f"Cannot cancel a batch with status {b.status!r}.", code="batch_not_cancellable")
        if self.publisher is not None:
            # Its chunks no longer hold the tenant's window: its other batches may go on at once.
            top_up(self.store, self.publisher, self.windows, tenant=tenant)
        return self.get_batch(tenant, batch_id)
