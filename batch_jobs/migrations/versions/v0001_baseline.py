"""Baseline: the batch tier's tables as they were before tenants got a dispatch row (c199a3e^).

Written out in full rather than from ``batch_jobs.models``, so that it keeps creating exactly
this schema however the models change later.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _files() -> None:
    op.create_table(
        "tidal_files",
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Integer(), nullable=True),
        sa.Column("path", sa.String(length=512), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_tidal_files_id", "tidal_files", ["id"], unique=True)
    op.create_index("ix_tidal_files_tenant", "tidal_files", ["tenant"], unique=False)


def _batches() -> None:
    op.create_table(
        "tidal_batches",
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("lane", sa.String(length=16), nullable=False),
        sa.Column("queue_lane", sa.String(length=16), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=True),
        sa.Column("replica_group", sa.String(length=128), nullable=True),
        sa.Column("feature", sa.String(length=128), nullable=True),
        sa.Column("regions_json", sa.Text(), nullable=True),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("in_progress_at", sa.Integer(), nullable=True),
        sa.Column("expires_at", sa.Integer(), nullable=True),
        sa.Column("finalizing_at", sa.Integer(), nullable=True),
        sa.Column("completed_at", sa.Integer(), nullable=True),
        sa.Column("failed_at", sa.Integer(), nullable=True),
        sa.Column("expired_at", sa.Integer(), nullable=True),
        sa.Column("cancelling_at", sa.Integer(), nullable=True),
        sa.Column("cancelled_at", sa.Integer(), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("errors_json", sa.Text(), nullable=True),
        sa.Column("metadata_json", sa.Text(), nullable=True),
        sa.Column("usage_json", sa.Text(), nullable=True),
        sa.Column("final_claim", sa.String(length=64), nullable=True),
        sa.Column("final_claimed_at", sa.Float(), nullable=True),
        sa.Column("final_status", sa.String(length=16), nullable=True),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_tidal_batches_id", "tidal_batches", ["id"], unique=True)
    op.create_index("ix_tidal_batches_job_id", "tidal_batches", ["job_id"], unique=False)
    op.create_index("ix_tidal_batches_status", "tidal_batches", ["status"], unique=False)
    op.create_index("ix_tidal_batches_tenant", "tidal_batches", ["tenant"], unique=False)


def _lines_and_chunks() -> None:
    op.create_table(
        "tidal_batch_lines",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=False),
        sa.Column("chunk_no", sa.Integer(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=8), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("request_id", sa.String(length=256), nullable=True),
        sa.Column("response_body", sa.Text(), nullable=True),
        sa.Column("error_json", sa.Text(), nullable=True),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("batch_id", "line_no"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_tidal_batch_lines_custom_id"),
    )
    op.create_index("ix_tidal_batch_lines_chunk", "tidal_batch_lines", ["batch_id", "chunk_no"], unique=False)
    op.create_index("ix_tidal_batch_lines_state", "tidal_batch_lines", ["batch_id", "state"], unique=False)
    op.create_table(
        "tidal_batch_chunks",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("chunk_no", sa.Integer(), nullable=False),
        sa.Column("queue_lane", sa.String(length=16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("first_line", sa.Integer(), nullable=False),
        sa.Column("last_line", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("deliveries", sa.Integer(), nullable=False),
        sa.Column("releases", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("published_at", sa.Float(), nullable=True),
        sa.Column("publish_claim", sa.String(length=32), nullable=True),
        sa.Column("heartbeat_at", sa.Float(), nullable=True),
        sa.Column("worker", sa.String(length=256), nullable=True),
        sa.PrimaryKeyConstraint("batch_id", "chunk_no"),
    )
    op.create_index("ix_tidal_batch_chunks_state", "tidal_batch_chunks", ["state"], unique=False)


def _jobs() -> None:
    op.create_table(
        "tidal_jobs",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("completed_at", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("options_json", sa.Text(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=True),
        sa.Column("batch_ids_json", sa.Text(), nullable=False),
        sa.Column("state_json", sa.Text(), nullable=True),
        sa.Column("result_json", sa.Text(), nullable=True),
        sa.Column("output_file_ids_json", sa.Text(), nullable=False),
        sa.Column("advance_claim", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_tidal_jobs_id", "tidal_jobs", ["id"], unique=True)
    op.create_index("ix_tidal_jobs_tenant", "tidal_jobs", ["tenant"], unique=False)


def _lanes_workers_replicas() -> None:
    op.create_table(
        "tidal_lane_state",
        sa.Column("lane", sa.String(length=16), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.String(length=512), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("lane"),
    )
    op.create_table(
        "tidal_workers",
        sa.Column("hostname", sa.String(length=256), nullable=False),
        sa.Column("lane", sa.String(length=16), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("paused_lanes", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("hostname"),
    )
    op.create_index("ix_tidal_workers_lane", "tidal_workers", ["lane"], unique=False)
    op.create_table(
        "tidal_runtime_replicas",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("group", sa.String(length=128), nullable=False),
        sa.Column("max_loras", sa.Integer(), nullable=False),
        sa.Column("registered_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_index("ix_tidal_runtime_replicas_pool", "tidal_runtime_replicas", ["pool"], unique=False)


def upgrade() -> None:
    _files()
    _batches()
    _lines_and_chunks()
    _jobs()
    _lanes_workers_replicas()


def downgrade() -> None:
    for table in (
        "tidal_runtime_replicas",
        "tidal_workers",
        "tidal_lane_state",
        "tidal_jobs",
        "tidal_batch_chunks",
        "tidal_batch_lines",
        "tidal_batches",
        "tidal_files",
    ):
        op.drop_table(table)  # its indexes go with it
