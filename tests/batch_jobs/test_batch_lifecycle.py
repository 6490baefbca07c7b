"""A batch's life in the store, on SQLite and PostgreSQL: planning, idempotent results, exactly one
finaliser, cancellation and expiry (injected clock) with partial results. On SQLite the files live
in a local directory, on PostgreSQL in its large objects (as a deployment across hosts runs)."""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from tests.batch_tier import chat_lines, read_jsonl
from tidal.batch_jobs.dispatch import PublishError, publish_pending
from tidal.batch_jobs.files import FileStore, LocalFileStore
from tidal.batch_jobs.finalize import finalize_batch, release_stale_claims
from tidal.batch_jobs.maintenance import BatchMaintenance
from tidal.batch_jobs.models import BatchCreate
from tidal.batch_jobs.results import LineResult, record_results
from tidal.batch_jobs.service import BatchService
from tidal.batch_jobs.store import (
    Store,
    lane_paused,
    line_counts,
    register_worker,
    set_lane_paused,
    workers_of_lane,
)
from tidal.clock import ManualClock
from tidal.fleet import parse_fleet
from tidal.settings import Settings

T0 = 1_800_000_000.0


class RecordingPublisher:
    """Stands in for the broker in these store-logic tests (the broker has its own tests)."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, int, str, int]] = []
        self.fail = fail

    def publish(self, batch_id: str, chunk_no: int, *, lane: str, priority: int) -> None:
        if self.fail:
            raise PublishError("broker down")
        self.sent.append((batch_id, chunk_no, lane, priority))


@pytest.fixture
def svc(database_url: str, tmp_path: Path) -> Iterator[BatchService]:
    fleet = parse_fleet({"models": [{"name": "tiny"}], "pools": {"b": {"kind": "batch", "model": "tiny"}}})
    settings = Settings(_env_file=None, data_dir=tmp_path, chunk_lines=10)  # type: ignore[call-arg]
    store = Store.from_url(database_url)
    files: FileStore
    if database_url.startswith("postgresql"):
        from tidal.batch_jobs.files_postgres import PostgresFileStore

        files = PostgresFileStore(database_url, max_bytes=10_000_000)
    else:
        files = LocalFileStore(tmp_path / "files", max_bytes=10_000_000)
    service = BatchService(
        store=store,
        files=files,
        fleet=fleet,
        settings=settings,
        publisher=RecordingPublisher(),
        clock=ManualClock(start=T0),
    )
    yield service
    store.dispose()


async def _chunks(data: bytes) -> object:
    yield data


async def _upload(svc: BatchService, data: bytes, tenant: str = "acme") -> str:
    f = await svc.upload_file(tenant, filename="in.jsonl", purpose="batch", chunks=_chunks(data))  # type: ignore[arg-type]
    return f.id


def _create(svc: BatchService, file_id: str, **metadata: str) -> str:
    b = svc.create_batch(
        "acme",
        BatchCreate(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=metadata or None,
        ),
    )
    return b.id


def _answer(line_no: int) -> LineResult:
    body = json.dumps(
        {
            "choices": [{"message": {"content": f"answer {line_no}"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        }
    )
    return LineResult.ok(line_no, f"req-{line_no}", body, {"prompt_tokens": 3, "completion_tokens": 2})


def _sweeper(svc: BatchService) -> BatchMaintenance:
    return BatchMaintenance(svc.store, svc.files, clock=svc.clock, publisher=None)


def _file_lines(svc: BatchService, file_id: str | None) -> list[dict[str, object]]:
    if file_id is None:
        return []
    with svc.open_file("acme", file_id) as f:
        return read_jsonl(f.read().decode())


pytestmark = pytest.mark.anyio


async def test_a_batch_is_planned_into_chunks_and_published_most_urgent_first(svc: BatchService) -> None:
    # Given two batches, the second more urgent
    low = _create(svc, await _upload(svc, chat_lines(25)), priority="1")
    high = _create(svc, await _upload(svc, chat_lines(5)), priority="9", lane="spot")
    # Then each was split into chunks of 10 lines and published as it was created
    sent = svc.publisher.sent  # type: ignore[union-attr]
    assert [(b, c) for b, c, _, _ in sent] == [(low, 0), (low, 1), (low, 2), (high, 0)]
    assert {(lane, p) for b, _, lane, p in sent if b == high} == {("spot", 9)}
    assert {(lane, p) for b, _, lane, p in sent if b == low} == {("shared", 1)}


async def test_unpublished_chunks_stay_pending_until_the_broker_takes_them(svc: BatchService) -> None:
    # Given a broker that refuses messages
    svc.publisher = RecordingPublisher(fail=True)
    a = _create(svc, await _upload(svc, chat_lines(15)), priority="2")
    b = _create(svc, await _upload(svc, chat_lines(5)), priority="8")
    # When it comes back, the sweep publishes what is pending, most urgent first
    ok = RecordingPublisher()
    assert publish_pending(svc.store, ok) == 3
    assert [(x, c) for x, c, _, _ in ok.sent] == [(b, 0), (a, 0), (a, 1)]
    # And nothing is published twice
    assert publish_pending(svc.store, ok) == 0


async def test_results_are_recorded_once_per_custom_id(svc: BatchService) -> None:
    bid = _create(svc, await _upload(svc, chat_lines(3)))
    # When the same line is answered twice (a redelivered chunk)
    assert record_results(svc.store, bid, [_answer(1), _answer(2)]) == 2
    assert record_results(svc.store, bid, [_answer(2), _answer(3)]) == 1
    # Then it counts once
    with svc.store.session() as s:
        assert line_counts(s, bid).model_dump() == {"total": 3, "completed": 3, "failed": 0}


async def test_exactly_one_finaliser_and_no_result_after_it(svc: BatchService) -> None:
    bid = _create(svc, await _upload(svc, chat_lines(4)))
    record_results(svc.store, bid, [_answer(n) for n in range(1, 5)])
    # When eight finalisers race
    winners: list[object] = []

    def finalise() -> None:
        winners.append(finalize_batch(svc.store, svc.files, bid, kind="complete", clock=svc.clock))

    threads = [threading.Thread(target=finalise) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Then one wrote the files
    done = [w for w in winners if w is not None]
    assert len(done) == 1
    b = svc.get_batch("acme", bid)
    assert b.status == "completed" and b.completed == 4 and b.failed == 0 and b.error_file_id is None
    out = _file_lines(svc, b.output_file_id)
    assert [o["custom_id"] for o in out] == ["r0", "r1", "r2", "r3"]
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == "answer 1"  # type: ignore[index]
    assert json.loads(b.usage_json or "{}")["total_tokens"] == 20


async def test_cancel_keeps_partial_results_and_accounts_for_every_line(svc: BatchService) -> None:
    bid = _create(svc, await _upload(svc, chat_lines(10)))
    record_results(svc.store, bid, [_answer(1), _answer(2), LineResult.failure(3, "replica_error", "boom")])
    # When the batch is cancelled
    assert svc.cancel_batch("acme", bid).status == "cancelling"
    assert svc.cancel_batch("acme", bid).status == "cancelling"  # idempotent
    assert _sweeper(svc).sweep()["cancelled"] == 1
    # Then answered lines are in the output, the rest in the error file, each exactly once
    b = svc.get_batch("acme", bid)
    assert b.status == "cancelled" and b.cancelled_at is not None
    out = _file_lines(svc, b.output_file_id)
    err = _file_lines(svc, b.error_file_id)
    assert [o["custom_id"] for o in out] == ["r0", "r1"]
    assert sorted(e["custom_id"] for e in err) == sorted(f"r{i}" for i in range(2, 10))
    codes = {e["custom_id"]: e["error"]["code"] for e in err}  # type: ignore[index]
    assert codes["r2"] == "replica_error" and codes["r9"] == "batch_cancelled"
    assert (b.total, b.completed, b.failed) == (10, 2, 8)
    # And a result arriving late is refused
    assert record_results(svc.store, bid, [_answer(5)]) == 0


async def test_completion_window_expiry_with_an_injected_clock(svc: BatchService) -> None:
    bid = _create(svc, await _upload(svc, chat_lines(6)))
    record_results(svc.store, bid, [_answer(1), _answer(4)])
    clock = svc.clock
    assert isinstance(clock, ManualClock)
    # Given the window has not passed, nothing expires
    clock.advance(24 * 3600 - 1)
    assert _sweeper(svc).sweep()["expired"] == 0
    # When it passes
    clock.advance(2)
    assert _sweeper(svc).sweep()["expired"] == 1
    # Then the batch is expired with its partial results, as OpenAI returns them
    b = svc.get_batch("acme", bid)
    assert b.status == "expired" and b.expired_at == int(T0 + 24 * 3600 + 1)
    assert [o["custom_id"] for o in _file_lines(svc, b.output_file_id)] == ["r0", "r3"]
    err = _file_lines(svc, b.error_file_id)
    assert {e["error"]["code"] for e in err} == {"batch_expired"}  # type: ignore[index]
    assert len(err) == 4


async def test_a_deadline_in_metadata_expires_the_batch_earlier(svc: BatchService) -> None:
    bid = _create(svc, await _upload(svc, chat_lines(2)), deadline=str(int(T0 + 600)))
    assert svc.get_batch("acme", bid).expires_at == int(T0 + 600)
    svc.clock.advance(601)  # type: ignore[attr-defined]
    assert _sweeper(svc).sweep()["expired"] == 1


async def test_a_finished_batch_nobody_finalised_is_finalised_by_the_sweep(svc: BatchService) -> None:
    bid = _create(svc, await _upload(svc, chat_lines(2)))
    record_results(svc.store, bid, [_answer(1), _answer(2)])
    assert _sweeper(svc).sweep()["completed"] == 1
    assert svc.get_batch("acme", bid).status == "completed"


async def test_a_dead_finalisers_claim_is_released(svc: BatchService) -> None:
    bid = _create(svc, await _upload(svc, chat_lines(1)))
    record_results(svc.store, bid, [_answer(1)])
    # Given a finaliser claimed the batch and died
    with svc.store.session() as s:
        s.connection().execute(
            text(
                "UPDATE tidal_batches SET final_claim = 'dead', final_claimed_at = 0, status = 'finalizing' WHERE id = :b"
            ),
            {"b": bid},
        )
    # When its claim is stale, it is released and the batch completes
    assert release_stale_claims(svc.store, now=T0) == 1
    assert _sweeper(svc).sweep()["completed"] == 1
    assert svc.get_batch("acme", bid).status == "completed"


class _FullAfter:
    """Wraps a file store: the ``n``-th file written and after fail as a full disk does."""

    def __init__(self, inner: FileStore, n: int) -> None:
        self.inner, self.left, self.full = inner, n, True

    def save_lines(self, tenant: str, file_id: str, lines: object) -> tuple[str, int]:
        if self.full and self.left <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.left -= 1
        return self.inner.save_lines(tenant, file_id, lines)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


async def test_a_full_file_store_at_finalisation_leaves_nothing_and_the_next_sweep_finishes(
    svc: BatchService,
) -> None:
    bid = _create(svc, await _upload(svc, chat_lines(2)))
    # One line answered, one failed: an output and an error file to write.
    record_results(svc.store, bid, [_answer(1), LineResult.failure(2, "server_error", "boom")])
    files_before = {f.id for f in svc.list_files("acme").data}
    full = _FullAfter(svc.files, 1)  # the output file fits, the error file does not
    sweeper = BatchMaintenance(svc.store, full, clock=svc.clock, publisher=None)  # type: ignore[arg-type]
    # When the disk is full: no final status, no file left behind, the claim released at once
    assert sweeper.sweep()["completed"] == 0
    batch = svc.get_batch("acme", bid)
    assert batch.status == "in_progress" and batch.output_file_id is None
    assert {f.id for f in svc.list_files("acme").data} == files_before
    with svc.store.session() as s:
        claim = s.connection().execute(
            text("SELECT final_claim FROM tidal_batches WHERE id = :b"), {"b": bid}
        )
        assert claim.scalar_one() is None
    # Then, with room again, the next sweep (not one after the stale-claim timeout) completes it
    full.full = False
    assert sweeper.sweep()["completed"] == 1
    batch = svc.get_batch("acme", bid)
    assert batch.status == "completed"
    assert [ln["custom_id"] for ln in _file_lines(svc, batch.output_file_id)] == ["r0"]
    assert [ln["custom_id"] for ln in _file_lines(svc, batch.error_file_id)] == ["r1"]


def test_lane_state_and_worker_registry(database_url: str) -> None:
    store = Store.from_url(database_url)
    try:
        with store.session() as s:
            assert not lane_paused(s, "shared")
            set_lane_paused(s, "shared", True, "TTFT p95 over budget")
            register_worker(s, hostname="shared@h-1", lane="shared", pid=1, concurrency=2)
            register_worker(s, hostname="all@h-2", lane="all", pid=2, concurrency=2)
            register_worker(s, hostname="spot@h-3", lane="spot", pid=3, concurrency=2)
        with store.session() as s:
            assert lane_paused(s, "shared")
            assert workers_of_lane(s, "shared") == ["all@h-2", "shared@h-1"]
            set_lane_paused(s, "shared", False)
        with store.session() as s:
            assert not lane_paused(s, "shared")
    finally:
        store.dispose()
