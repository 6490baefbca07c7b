"""SQLModel tables of the batch tier and the OpenAI-shaped models the API returns.

Storage (``XRecord``, ``table=True``), input (``XCreate``) and output (``XPublic``) are separate
types. Every row that belongs to someone carries its ``tenant``; every query filters by it.

Status values follow OpenAI's ``Batch.status``; lines and chunks have their own small state sets.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field as PydField
from sqlalchemy import Column, Index, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

__all__ = [
    "BATCH_ACTIVE",
    "BATCH_TERMINAL",
    "BatchChunk",
    "BatchCreate",
    "BatchErrorItem",
    "BatchLine",
    "BatchPublic",
    "BatchRecord",
    "BatchStatus",
    "ChunkState",
    "FilePublic",
    "FileRecord",
    "JobCreate",
    "JobPublic",
    "JobRecord",
    "LaneState",
    "LinePublicState",
    "ListPage",
    "RequestCounts",
    "TenantDispatch",
    "WorkerRecord",
]

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
BATCH_TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
BATCH_ACTIVE: frozenset[str] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})

LinePublicState = Literal["pending", "done", "failed"]
# pending: not sent yet (or not answered); done: in the output file; failed: in the error file.
# pending: waiting to be published (until its tenant's window has room); publishing: a publisher
# claimed it; queued: the broker has it; running: a worker holds it; done: every line has a
# result; dead: past the delivery limit. publishing, queued and running fill the window.
ChunkState = Literal["pending", "publishing", "queued", "running", "done", "dead"]


def _text() -> Any:
    return Field(default=None, sa_column=Column(Text, nullable=True))


# -- files --------------------------------------------------------------------------------------


class FileBase(SQLModel):
    """Shared properties of an uploaded or generated file."""

    purpose: str = Field(max_length=32)
    filename: str = Field(max_length=255)
    bytes: int = Field(ge=0)


class FileRecord(FileBase, table=True):
    """Database model: the bytes live in the file store (``TIDAL_FILES_URL``, else ``files_dir``);
    ``path`` is the store's reference to them."""

    __tablename__ = "tidal_files"

    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(max_length=64, unique=True, index=True)
    tenant: str = Field(max_length=128, index=True)
    created_at: int
    expires_at: int | None = None
    path: str = Field(max_length=512)


class FilePublic(BaseModel):
    """OpenAI ``FileObject``."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def of(cls, f: FileRecord) -> FilePublic:
        return cls(
            id=f.id,
            bytes=f.bytes,
            created_at=f.created_at,
            filename=f.filename,
            purpose=f.purpose,
            expires_at=f.expires_at,
        )


# -- batches ------------------------------------------------------------------------------------


class BatchCreate(BaseModel):
    """Properties received on ``POST /v1/batches`` (OpenAI ``BatchCreateParams``).

    Tidal's extensions go in ``metadata``: ``priority`` ("0".."9", 9 most urgent), ``lane``
    (``reserved``/``spot``/``any``), ``deadline`` (Unix seconds, an earlier expiry), ``feature``
    (whose ``regions`` its lines stay in); admins may also pin ``pool`` and ``replica_group``
    (e.g. to evaluate a canary).
    """

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = PydField(min_length=1, max_length=64)
    endpoint: str = PydField(min_length=1, max_length=64)
    completion_window: str = PydField(min_length=1, max_length=16)
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


class BatchErrorItem(BaseModel):
    """OpenAI ``BatchError``: one problem with the input file, by line number (1-based)."""

    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchBase(SQLModel):
    """Shared properties of a batch."""

    endpoint: str = Field(max_length=64)
    input_file_id: str = Field(max_length=64)
    completion_window: str = Field(max_length=16)


class BatchRecord(BatchBase, table=True):
    """Database model of a batch. Live counts come from its lines; final ones are stored."""

    __tablename__ = "tidal_batches"

    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(max_length=64, unique=True, index=True)
    tenant: str = Field(max_length=128, index=True)
    status: str = Field(max_length=16, index=True)
    model: str | None = Field(default=None, max_length=256)
    priority: int = 0
    lane: str = Field(default="any", max_length=16)
    queue_lane: str = Field(default="shared", max_length=16)
    pool: str | None = Field(default=None, max_length=128)
    replica_group: str | None = Field(default=None, max_length=128)
    # The batch's feature, and its regions as JSON (null: its lines may run anywhere).
    feature: str | None = Field(default=None, max_length=128)
    regions_json: str | None = _text()
    job_id: str | None = Field(default=None, max_length=64, index=True)
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = Field(default=None, max_length=64)
    error_file_id: str | None = Field(default=None, max_length=64)
    total: int = 0
    completed: int = 0
    failed: int = 0
    errors_json: str | None = _text()
    metadata_json: str | None = _text()
    usage_json: str | None = _text()
    # Exactly one finaliser: set by a conditional UPDATE; result writes check that it is unset.
    final_claim: str | None = Field(default=None, max_length=64)
    final_claimed_at: float | None = None
    final_status: str | None = Field(default=None, max_length=16)

    @property
    def allowed_regions(self) -> frozenset[str] | None:
        """The regions whose replicas may run its lines; ``None``: any."""
        return frozenset(json.loads(self.regions_json)) if self.regions_json else None


class BatchPublic(BaseModel):
    """OpenAI ``Batch``."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    model: str | None = None
    errors: dict[str, Any] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = PydField(default_factory=RequestCounts)
    usage: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None

    @classmethod
    def of(cls, b: BatchRecord, counts: RequestCounts) -> BatchPublic:
        errors = json.loads(b.errors_json) if b.errors_json else None
        return cls(
            id=b.id,
            endpoint=b.endpoint,
            input_file_id=b.input_file_id,
            completion_window=b.completion_window,
            status=b.status,
            created_at=b.created_at,
            model=b.model,
            errors={"object": "list", "data": errors} if errors is not None else None,
            output_file_id=b.output_file_id,
            error_file_id=b.error_file_id,
            in_progress_at=b.in_progress_at,
            expires_at=b.expires_at,
            finalizing_at=b.finalizing_at,
            completed_at=b.completed_at,
            failed_at=b.failed_at,
            expired_at=b.expired_at,
            cancelling_at=b.cancelling_at,
            cancelled_at=b.cancelled_at,
            request_counts=counts,
            usage=json.loads(b.usage_json) if b.usage_json else None,
            metadata=json.loads(b.metadata_json) if b.metadata_json else None,
        )


class BatchLine(SQLModel, table=True):
    """One request line of a batch and, once answered, its result.

    A result is written by a conditional UPDATE (``state = 'pending'``), so a line answered twice
    (redelivery after a crash) is recorded once: keyed by (batch, custom_id).
    """

    __tablename__ = "tidal_batch_lines"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_tidal_batch_lines_custom_id"),
        Index("ix_tidal_batch_lines_state", "batch_id", "state"),
        Index("ix_tidal_batch_lines_chunk", "batch_id", "chunk_no"),
    )

    batch_id: str = Field(max_length=64, primary_key=True)
    line_no: int = Field(primary_key=True)
    custom_id: str = Field(max_length=512)
    chunk_no: int
    body: str = Field(sa_column=Column(Text, nullable=False))
    state: str = Field(default="pending", max_length=8)
    status_code: int | None = None
    request_id: str | None = Field(default=None, max_length=256)
    response_body: str | None = _text()
    error_json: str | None = _text()
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


class BatchChunk(SQLModel, table=True):
    """A slice of a batch's lines that travels as one Celery task."""

    __tablename__ = "tidal_batch_chunks"
    __table_args__ = (Index("ix_tidal_batch_chunks_state", "state"),)

    batch_id: str = Field(max_length=64, primary_key=True)
    chunk_no: int = Field(primary_key=True)
    queue_lane: str = Field(max_length=16)
    priority: int = 0
    first_line: int
    last_line: int
    state: str = Field(default="pending", max_length=16)
    deliveries: int = 0
    releases: int = 0
    created_at: float = 0.0
    published_at: float | None = None
    publish_claim: str | None = Field(default=None, max_length=32)
    heartbeat_at: float | None = None
    worker: str | None = Field(default=None, max_length=256)


class TenantDispatch(SQLModel, table=True):
    """One row per tenant with batch work: the row its dispatchers and its submissions lock, so
    that two gateways (or workers) topping up the same tenant never publish past its window and
    two submissions never both pass its ``max_lines_queued``; and when its chunks last went out,
    so the tenant served longest ago goes first (round robin across tenants)."""

    __tablename__ = "tidal_batch_tenants"

    tenant: str = Field(max_length=128, primary_key=True)
    dispatched_at: float = 0.0


# -- jobs ---------------------------------------------------------------------------------------


class JobCreate(BaseModel):
    """Properties received on ``POST /v1/jobs``: a job kind, its dataset file and options.

    ``options`` are validated by the kind (see ``batch_jobs.jobs``).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["eval", "embedding_backfill", "summaries"]
    input_file_id: str = PydField(min_length=1, max_length=64)
    model: str = PydField(min_length=1, max_length=256)
    options: dict[str, Any] = PydField(default_factory=dict)
    metadata: dict[str, str] | None = None


class JobRecord(SQLModel, table=True):
    """Database model of a job: its kind, options, current stage and batches."""

    __tablename__ = "tidal_jobs"

    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(max_length=64, unique=True, index=True)
    tenant: str = Field(max_length=128, index=True)
    kind: str = Field(max_length=32)
    model: str = Field(max_length=256)
    input_file_id: str = Field(max_length=64)
    status: str = Field(default="in_progress", max_length=16)
    stage: int = 0
    batch_id: str | None = Field(default=None, max_length=64)
    created_at: int
    completed_at: int | None = None
    error: str | None = _text()
    options_json: str = Field(sa_column=Column(Text, nullable=False))
    metadata_json: str | None = _text()
    batch_ids_json: str = Field(default="[]", sa_column=Column(Text, nullable=False))
    state_json: str | None = _text()
    result_json: str | None = _text()
    output_file_ids_json: str = Field(default="{}", sa_column=Column(Text, nullable=False))
    advance_claim: str | None = Field(default=None, max_length=64)


class JobPublic(BaseModel):
    """A job as the API returns it."""

    id: str
    object: Literal["job"] = "job"
    kind: str
    model: str
    input_file_id: str
    status: str
    stage: int
    created_at: int
    completed_at: int | None = None
    batch_ids: list[str]
    current_batch: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    output_file_ids: dict[str, str]
    error: str | None = None
    metadata: dict[str, str] | None = None


# -- lane gate and workers ----------------------------------------------------------------------


class LaneState(SQLModel, table=True):
    """Persisted gate state of a lane: a worker that starts while its lane is paused does not
    consume that lane's queue until it is resumed."""

    __tablename__ = "tidal_lane_state"

    lane: str = Field(max_length=16, primary_key=True)
    paused: bool = False
    reason: str = Field(default="", max_length=512)
    updated_at: float = 0.0


class WorkerRecord(SQLModel, table=True):
    """A running worker (registered at start, heartbeat while alive): who consumes which lane."""

    __tablename__ = "tidal_workers"

    hostname: str = Field(max_length=256, primary_key=True)
    lane: str = Field(max_length=16, index=True)
    pid: int
    concurrency: int
    started_at: float
    heartbeat_at: float
    # The lanes this worker currently treats as paused (comma-separated), so a pause can be
    # confirmed from the store where the broker has no remote control (the embedded fallback).
    paused_lanes: str = Field(default="", max_length=64)


class RuntimeReplica(SQLModel, table=True):
    """A replica registered with a gateway at run time (``POST /admin/replicas``: the autoscaler's
    local actuator, a canary roll-out) rather than in the fleet file, so that batch workers send
    to it too; its row goes when it is deregistered (``DELETE``), before it drains."""

    __tablename__ = "tidal_runtime_replicas"

    name: str = Field(max_length=128, primary_key=True)
    pool: str = Field(max_length=128, index=True)
    url: str = Field(max_length=2048)
    group: str = Field(default="stable", max_length=128)
    max_loras: int = 0
    registered_at: float = 0.0


class ListPage(BaseModel):
    """OpenAI cursor page: ``{object: "list", data, first_id, last_id, has_more}``."""

    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
