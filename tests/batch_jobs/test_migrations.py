"""Schema migrations, on SQLite and PostgreSQL: the newest revision makes exactly the tables of
``batch_jobs.models``; a database at the baseline with data in it upgrades and keeps every row; a
database that ``create_all`` made before migrations existed is recognised, stamped and upgraded;
several processes starting on one fresh database at once all come up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, MetaData, inspect, select, text
from sqlmodel import Session, SQLModel

from tidal.batch_jobs import migrations
from tidal.batch_jobs.models import (
    BatchChunk,
    BatchLine,
    BatchRecord,
    FileRecord,
    JobRecord,
    LaneState,
    RuntimeReplica,
    TenantDispatch,
    WorkerRecord,
)
from tidal.batch_jobs.store import Store, lane_paused, make_engine

TENANTS = "tidal_batch_tenants"  # the table revision 0002 adds


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


def _migrate_to(engine: Engine, revision: str) -> None:
    with engine.begin() as conn:
        command.upgrade(migrations.alembic_config(conn), revision)


def _revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return migrations.current_revision(conn)


def _schema_diff(engine: Engine) -> list[Any]:
    """What autogenerate would still change to reach ``SQLModel.metadata``: nothing, when the
    migrations are right."""
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "include_name": migrations.include_name,
                "version_table": migrations.VERSION_TABLE,
                "compare_type": True,
            },
        )
        return list(compare_metadata(context, SQLModel.metadata))


def _fill(engine: Engine) -> None:
    """A little of everything the baseline has: a file, a batch with lines in each state and a
    chunk, a job, a paused lane, a worker and a run-time replica."""
    with Session(engine) as s:
        s.add(
            FileRecord(
                id="file-in",
                tenant="acme",
                purpose="batch",
                filename="in.jsonl",
                bytes=123,
                created_at=1_700_000_000,
                expires_at=None,
                path="acme/file-in",
            )
        )
        s.add(
            BatchRecord(
                id="batch-1",
                tenant="acme",
                status="in_progress",
                endpoint="/v1/chat/completions",
                input_file_id="file-in",
                completion_window="24h",
                model="tiny",
                priority=7,
                lane="reserved",
                feature="batch/default",
                regions_json='["eu"]',
                job_id="job-1",
                created_at=1_700_000_001,
                in_progress_at=1_700_000_002,
                metadata_json='{"priority": "7"}',
                final_claimed_at=None,
            )
        )
        lines = [  # state, status code, response, error
            ("done", 200, '{"ok": true}', None),
            ("failed", 400, None, '{"code": "invalid"}'),
            ("pending", None, None, None),
        ]
        for no, (state, code, response, error) in enumerate(lines, start=1):
            s.add(
                BatchLine(
                    batch_id="batch-1",
                    line_no=no,
                    custom_id=f"req-{no} ünïcode",
                    chunk_no=0,
                    body='{"messages": [{"role": "user", "content": "hi"}]}',
                    state=state,
                    status_code=code,
                    response_body=response,
                    error_json=error,
                    input_tokens=no * 10,
                    output_tokens=no,
                    cached_tokens=no // 2,
                )
            )
        s.add(
            BatchChunk(
                batch_id="batch-1",
                chunk_no=0,
                queue_lane="shared",
                priority=7,
                first_line=1,
                last_line=3,
                state="running",
                deliveries=2,
                created_at=1_700_000_001.25,
                heartbeat_at=1_700_000_005.5,
                worker="shared@host-1",
            )
        )
        s.add(
            JobRecord(
                id="job-1",
                tenant="acme",
                kind="eval",
                model="tiny",
                input_file_id="file-in",
                stage=1,
                batch_id="batch-1",
                created_at=1_700_000_000,
                options_json='{"scorer": "exact"}',
                batch_ids_json='["batch-1"]',
            )
        )
        s.add(
            LaneState(lane="shared", paused=True, reason="interactive p95 0.8 s", updated_at=1_700_000_003.5)
        )
        s.add(
            WorkerRecord(
                hostname="shared@host-1",
                lane="shared",
                pid=4242,
                concurrency=8,
                started_at=1_700_000_000.5,
                heartbeat_at=1_700_000_004.75,
                paused_lanes="shared",
            )
        )
        s.add(
            RuntimeReplica(name="r-1", pool="chat", url="http://10.0.0.7:8000", group="canary", max_loras=2)
        )
        s.commit()


def _snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the baseline, in primary-key order."""
    meta = MetaData()
    with engine.connect() as conn:
        meta.reflect(conn, only=[t for t in SQLModel.metadata.tables if t != TENANTS])
        return {
            name: [tuple(r) for r in conn.execute(select(table).order_by(*table.primary_key.columns)).all()]
            for name, table in meta.tables.items()
        }


def _create_all_as_before(engine: Engine, *, with_tenants: bool) -> None:
    """What ``Store`` did before migrations: ``create_all``, at today's models or (without the
    tenants table) at the baseline's."""
    tables = [t for t in SQLModel.metadata.sorted_tables if with_tenants or t.name != TENANTS]
    SQLModel.metadata.create_all(engine, tables=tables)


def test_head_makes_exactly_the_models(engine: Engine) -> None:
    Store(engine)

    assert _revision(engine) == migrations.HEAD
    assert _schema_diff(engine) == []
    script = ScriptDirectory(str(Path(migrations.__file__).parent))
    assert script.get_heads() == [migrations.HEAD]
    assert script.get_base() == migrations.BASELINE


def test_baseline_database_with_data_upgrades_and_keeps_every_row(engine: Engine) -> None:
    # Given a database at the baseline revision (before tidal_batch_tenants) holding work
    _migrate_to(engine, migrations.BASELINE)
    assert TENANTS not in inspect(engine).get_table_names()
    _fill(engine)
    before = _snapshot(engine)
    assert all(before.values()), before

    # When a newer gateway starts on it
    store = Store(engine)

    # Then it is at head, nothing was lost or changed, and the new table is in use
    assert _revision(engine) == migrations.HEAD
    assert _snapshot(engine) == before
    assert _schema_diff(engine) == []
    with store.session() as s:
        assert lane_paused(s, "shared")
        s.add(TenantDispatch(tenant="acme", dispatched_at=1_700_000_006.0))
    with store.session() as s:
        assert s.get(TenantDispatch, "acme") is not None


@pytest.mark.parametrize("with_tenants", [True, False], ids=["made-at-head", "made-at-baseline"])
def test_unversioned_database_from_create_all_is_stamped_and_upgraded(
    engine: Engine, with_tenants: bool
) -> None:
    # Given a database that create_all made before migrations existed (no version table)
    _create_all_as_before(engine, with_tenants=with_tenants)
    _fill(engine)
    before = _snapshot(engine)
    assert _revision(engine) is None

    # When the store starts on it: recognised by its tables, stamped (creating them again would
    # fail with "already exists") and upgraded
    store = Store(engine)

    assert _revision(engine) == migrations.HEAD
    assert _snapshot(engine) == before
    assert _schema_diff(engine) == []
    with store.session() as s:
        assert lane_paused(s, "shared")


def test_a_schema_older_than_the_baseline_is_refused_by_name(engine: Engine) -> None:
    SQLModel.metadata.create_all(engine, tables=[FileRecord.__table__])  # type: ignore[list-item]

    with pytest.raises(RuntimeError, match="tidal_batch_chunks"):
        Store(engine)


def test_a_store_starts_again_on_its_own_database(engine: Engine) -> None:
    with Store(engine).session() as s:
        s.add(LaneState(lane="spot", paused=True))

    with Store(engine).session() as s:
        assert lane_paused(s, "spot")
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {migrations.VERSION_TABLE}")).scalar_one() == 1


def test_in_memory_sqlite_still_works() -> None:
    store = Store.from_url("sqlite://")
    with store.session() as s:
        s.add(LaneState(lane="shared", paused=True))
    with store.session() as s:
        assert lane_paused(s, "shared")
    store.dispose()


def test_processes_starting_together_on_a_fresh_database_all_come_up(database_url: str) -> None:
    # Each thread has its own engine and connections, as each gateway and worker process does.
    n = 4
    start = threading.Barrier(n)
    failures: list[BaseException] = []
    stores: list[Store] = []

    def boot() -> None:
        start.wait()
        try:
            store = Store.from_url(database_url)
            with store.session() as s:
                lane_paused(s, "shared")
            stores.append(store)
        except BaseException as exc:
            failures.append(exc)

    # Daemons with one deadline: a start stuck on a lock fails the test instead of hanging it.
    threads = [threading.Thread(target=boot, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))

    assert failures == []
    assert len(stores) == n
    assert _revision(stores[0].engine) == migrations.HEAD
    assert _schema_diff(stores[0].engine) == []
    for store in stores:
        store.dispose()
