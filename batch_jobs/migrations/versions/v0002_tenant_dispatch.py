"""Tenants share the batch tier (c199a3e): one row per tenant with batch work, which its
dispatchers and submissions lock and which remembers when its chunks last went out.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Starts empty: a tenant's row is made the first time its row is locked (batch_jobs.dispatch),
    # so batches already open in an upgraded database need nothing backfilled.
    op.create_table(
        "tidal_batch_tenants",
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("dispatched_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("tenant"),
    )


def downgrade() -> None:
    op.drop_table("tidal_batch_tenants")
