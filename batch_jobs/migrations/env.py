"""Alembic's entry point for the batch tier's revisions. They run on the connection that
``batch_jobs.migrations.upgrade`` holds, inside its transaction and under its lock, never on one
of their own: a second connection would race the other processes starting at the same time."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection
from sqlmodel import SQLModel

from tidal.batch_jobs.migrations import VERSION_TABLE, include_name  # also registers the models' tables


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=SQLModel.metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        # SQLite alters a table by copying it; batch mode writes future ALTERs that way.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _connection() -> Connection:
    connection = context.config.attributes.get("connection")
    if context.is_offline_mode() or not isinstance(connection, Connection):
        raise RuntimeError(
            "the batch tier's migrations run on a live connection: "
            "batch_jobs.migrations.upgrade(engine) or alembic_config(connection)"
        )
    return connection


_run(_connection())
