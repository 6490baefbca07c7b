"""The batch tier's database: SQLite by default (WAL, busy timeout: several processes write),
PostgreSQL by URL (``postgresql+psycopg://``).

Example::

    store = Store.from_url(settings.resolved_database_url)
    with store.session() as s:
        set_lane_paused(s, "shared", True, "interactive queue wait p95 0.8 s")
        assert lane_paused(s, "shared")
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, func, text
from sqlmodel import Session, col, select

from tidal.batch_jobs import migrations
from tidal.batch_jobs.models import BatchLine, LaneState, RequestCounts, RuntimeReplica, WorkerRecord

__all__ = [
    "Store",
    "delete_runtime_replica",
    "lane_paused",
    "lane_states",
    "line_counts",
    "put_runtime_replica",
    "register_worker",
    "runtime_replicas",
    "set_lane_paused",
    "unregister_worker",
    "worker_count",
    "worker_paused_lanes",
    "workers_of_lane",
]


class Store:
    """An engine plus sessions; brings the database's schema to the newest revision on start
    (``batch_jobs.migrations``: creates it when empty, upgrades an older one)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        migrations.upgrade(engine)
        # SQLite has one writer at a time and its busy handler backs off in sleeps of up to 100 ms;
        # threads of one process take turns here instead (other processes still use the handler).
        self._turn: threading.RLock | None = threading.RLock() if engine.dialect.name == "sqlite" else None

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @classmethod
    def from_url(cls, url: str, *, echo: bool = False) -> Store:
        return cls(make_engine(url, echo=echo))

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on error."""
        with self._turn or contextlib.nullcontext(), Session(self.engine, expire_on_commit=False) as s:
            try:
                yield s
                s.commit()
            except BaseException:
                s.rollback()
                raise

    def dispose(self) -> None:
        self.engine.dispose()


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine tuned for several writer processes."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            # WAL lets readers run beside the one writer; the busy timeout makes writers queue
            # instead of failing when a worker and the gateway write at the same moment.
            cur.execute("PRAGMA busy_timeout=30000")
            _wal(cur)
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, echo=echo, pool_pre_ping=True, pool_size=5, max_overflow=10)


def _wal(cur: Any, timeout_s: float = 30.0) -> None:
    """Put the database in WAL mode. Processes that open a new database at the same moment race
    to switch it, and SQLite answers the losers "database is locked" at once, without its busy
    handler: they try again (the winner's switch takes milliseconds) until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


# -- lines --------------------------------------------------------------------------------------


def line_counts(session: Session, batch_id: str) -> RequestCounts:
    """``request_counts`` computed from the lines (never incremented per execution)."""
    rows = session.exec(
        select(BatchLine.state, func.count())
        .where(BatchLine.batch_id == batch_id)
        .group_by(col(BatchLine.state))
    ).all()
    by_state = {state: int(n) for state, n in rows}
    return RequestCounts(
        total=sum(by_state.values()),
        completed=by_state.get("done", 0),
        failed=by_state.get("failed", 0),
    )


# -- lane gate ------------------------------------------------------------------------------------


def set_lane_paused(session: Session, lane: str, paused: bool, reason: str = "") -> LaneState:
    """Persist the gate state of ``lane`` (the scheduler flips it; workers read it)."""
    row = session.get(LaneState, lane)
    if row is None:
        row = LaneState(lane=lane)
    row.paused = paused
    row.reason = reason[:512]
    row.updated_at = time.time()
    session.add(row)
    session.flush()
    return row


def lane_paused(session: Session, lane: str) -> bool:
    row = session.get(LaneState, lane)
    return bool(row and row.paused)


def lane_states(session: Session) -> dict[str, bool]:
    return {r.lane: r.paused for r in session.exec(select(LaneState)).all()}


# -- worker registry ------------------------------------------------------------------------------


def register_worker(
    session: Session,
    *,
    hostname: str,
    lane: str,
    pid: int,
    concurrency: int,
    paused_lanes: list[str] | None = None,
) -> None:
    """Insert or refresh this worker's row (also its heartbeat and its view of paused lanes)."""
    now = time.time()
    row = session.get(WorkerRecord, hostname)
    if row is None:
        row = WorkerRecord(
            hostname=hostname, lane=lane, pid=pid, concurrency=concurrency, started_at=now, heartbeat_at=now
        )
    row.heartbeat_at = now
    if paused_lanes is not None:
        row.paused_lanes = ",".join(sorted(paused_lanes))
    session.add(row)


def worker_paused_lanes(session: Session, hostnames: list[str]) -> dict[str, set[str]]:
    """Each worker's last reported set of paused lanes."""
    rows = session.exec(select(WorkerRecord).where(col(WorkerRecord.hostname).in_(hostnames))).all()
    return {r.hostname: {x for x in r.paused_lanes.split(",") if x} for r in rows}


def unregister_worker(session: Session, hostname: str) -> None:
    """Remove this worker's row from the registry (it is stopping)."""
    session.execute(text("DELETE FROM tidal_workers WHERE hostname = :h"), {"h": hostname})


def worker_count(session: Session) -> int:
    """How many workers are registered, live or not (a worker registers before it consumes)."""
    return int(session.connection().execute(text("SELECT COUNT(*) FROM tidal_workers")).scalar_one())


def workers_of_lane(session: Session, lane: str, *, stale_after_s: float = 30.0) -> list[str]:
    """Hostnames of live workers that consume ``lane`` (``all`` workers consume every lane)."""
    cutoff = time.time() - stale_after_s
    rows = session.exec(
        select(WorkerRecord.hostname).where(
            col(WorkerRecord.lane).in_([lane, "all"]), col(WorkerRecord.heartbeat_at) >= cutoff
        )
    ).all()
    return sorted(rows)


# -- replicas registered at run time ------------------------------------------------------------


def put_runtime_replica(
    session: Session, *, name: str, pool: str, url: str, group: str = "stable", max_loras: int = 0
) -> None:
    """Record (or replace) a replica a gateway registered at run time; workers read these."""
    row = session.get(RuntimeReplica, name) or RuntimeReplica(name=name, pool=pool, url=url)
    row.pool, row.url, row.group, row.max_loras = pool, url, group, max_loras
    row.registered_at = time.time()
    session.add(row)


def delete_runtime_replica(session: Session, name: str) -> bool:
    """Forget a run-time replica; False when there was none of that name."""
    row = session.get(RuntimeReplica, name)
    if row is None:
        return False
    session.delete(row)
    return True


def runtime_replicas(session: Session) -> list[RuntimeReplica]:
    return list(session.exec(select(RuntimeReplica).order_by(col(RuntimeReplica.name))).all())
