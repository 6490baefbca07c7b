"""Schema migrations of the batch tier's database (Alembic). ``Store`` runs ``upgrade`` on start,
so a gateway or worker of a newer version brings an existing database up to date by itself.

Revisions live in ``versions/``; no ``alembic.ini`` is needed (the package works installed). A
database made by ``create_all`` before migrations existed has no version: its tables tell which
revision it is at, it is stamped so, then upgraded.

A new revision, after changing a table in ``batch_jobs.models``::

    from alembic import command
    from sqlalchemy import create_engine
    from tidal.batch_jobs.migrations import alembic_config

    with create_engine("sqlite:////tmp/scratch.db").begin() as conn:
        command.upgrade(alembic_config(conn), "head")
        command.revision(alembic_config(conn), "what changed", autogenerate=True, rev_id="0003")
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.environment import NameFilterParentNames, NameFilterType
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, inspect, text
from sqlmodel import SQLModel

import tidal.batch_jobs.models  # noqa: F401  (registers the tables in SQLModel.metadata)

__all__ = [
    "BASELINE",
    "HEAD",
    "VERSION_TABLE",
    "alembic_config",
    "current_revision",
    "include_name",
    "upgrade",
]

BASELINE = "0001"
HEAD = "0002"
# Not Alembic's default name: the database may be shared with another application that keeps
# its own ``alembic_version``.
VERSION_TABLE = "tidal_alembic_version"

_BASELINE_TABLES = frozenset(
    {
        "tidal_files",
        "tidal_batches",
        "tidal_batch_lines",
        "tidal_batch_chunks",
        "tidal_jobs",
        "tidal_lane_state",
        "tidal_workers",
        "tidal_runtime_replicas",
    }
)
# What ``create_all`` made before migrations existed, newest first: a database without a version
# is at the first revision whose tables it has. Never extended: later databases carry a version.
_UNVERSIONED: tuple[tuple[str, frozenset[str]], ...] = (
    ("0002", _BASELINE_TABLES | {"tidal_batch_tenants"}),
    ("0001", _BASELINE_TABLES),
)
_KNOWN_TABLES = _UNVERSIONED[0][1]

# A PostgreSQL advisory-lock key of our own ("tidalm"; files_postgres holds "tidalf").
_PG_LOCK = 0x7469_6461_6C6D


def upgrade(engine: Engine) -> None:
    """Bring the database to the newest revision. The gateway and workers start together: the
    whole upgrade is one transaction under a lock, so the first one migrates and the others,
    waiting, find the database already at head."""
    with engine.connect() as conn:
        _lock(conn)
        _stamp_unversioned(conn)
        command.upgrade(alembic_config(conn), "head")
        conn.commit()


def alembic_config(connection: Connection) -> Config:
    """Alembic's configuration for these revisions, run on ``connection`` (see ``env.py``)."""
    config = Config()
    # ConfigParser interpolates '%': a path holding one would otherwise break the option.
    config.set_main_option("script_location", str(Path(__file__).parent).replace("%", "%%"))
    config.set_main_option("file_template", "v%%(rev)s_%%(slug)s")
    config.attributes["connection"] = connection
    return config


def current_revision(connection: Connection) -> str | None:
    """The revision the database is at; ``None`` when it has no version table."""
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def include_name(name: str | None, type_: NameFilterType, _parents: NameFilterParentNames) -> bool:
    """Compare only the batch tier's own tables, those of the models and those it ever had:
    others may share its database (the file store's ``tidal_file_blobs``, another
    application's)."""
    return type_ != "table" or name in SQLModel.metadata.tables or name in _KNOWN_TABLES


def _lock(conn: Connection) -> None:
    """Hold the schema until ``conn`` commits, so that two processes never both create tables
    (the loser's CREATE fails) or stamp a database the other has half made."""
    if conn.dialect.name == "postgresql":
        # Released at commit or rollback; DDL is transactional there, so waiters see all or none.
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
    elif conn.dialect.name == "sqlite":
        # The write lock now rather than at the first write; another process waits out the busy
        # timeout (30 s) for it. SQLite's DDL is transactional too.
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _stamp_unversioned(conn: Connection) -> None:
    """Give a database made by ``create_all`` (before migrations existed) the revision its
    tables match, so that upgrading does not try to create them again."""
    if current_revision(conn) is not None:
        return
    tables = set(inspect(conn).get_table_names())
    if not tables & _KNOWN_TABLES:
        return  # a fresh database: the upgrade creates everything
    for revision, expected in _UNVERSIONED:
        if expected <= tables:
            command.stamp(alembic_config(conn), revision)
            return
    missing = sorted(_BASELINE_TABLES - tables)
    raise RuntimeError(
        f"the database has some of the batch tier's tables but not {', '.join(missing)}: "
        "it is older than any schema this version can upgrade; move its data to a new database"
    )
