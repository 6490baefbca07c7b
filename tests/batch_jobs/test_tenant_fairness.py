"""Tenants sharing the batch tier, on SQLite and PostgreSQL: chunks are published progressively
into each tenant's window (round robin across tenants within a priority level, the most urgent
level first, each tenant's batches in order), never past it even with several dispatchers at
once; and a submission past a tenant's ``max_lines_queued`` is refused with 429, creating nothing.

The broker is a recording stand-in here (the order of publication is what these tests check);
tests/workers/test_fairness_e2e.py runs the same through RabbitMQ and a worker.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from tests.batch_tier import chat_lines, openai_client
from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.batch_jobs.dispatch import PublishError, Window, tenant_windows, top_up
from tidal.batch_jobs.errors import LimitExceeded
from tidal.batch_jobs.files import LocalFileStore
from tidal.batch_jobs.jobs import JobService
from tidal.batch_jobs.maintenance import BatchMaintenance
from tidal.batch_jobs.models import BatchCreate, JobCreate
from tidal.batch_jobs.service import BatchService
from tidal.batch_jobs.store import Store
from tidal.clock import ManualClock
from tidal.fleet import parse_fleet
from tidal.settings import Settings

T0 = 1_800_000_000.0
WINDOW = 2  # chunks per tenant and lane, for tenants without max_lines_in_flight
FLEET: dict[str, Any] = {
    "models": [{"name": "tiny"}],
    "pools": {"b": {"kind": "batch", "model": "tiny"}},
    "tenants": [
        {"name": "acme", "batch": {"max_lines_queued": 100}},
        {"name": "wide", "batch": {"max_lines_in_flight": 25}},
        {"name": "narrow", "batch": {"max_lines_in_flight": 5}},
    ],
}


class RecordingPublisher:
    """Stands in for the broker: records (batch, chunk) in the order published."""

    def __init__(self, *, fail: bool = False, delay_s: float = 0.0) -> None:
        self.sent: list[tuple[str, int]] = []
        self.fail = fail
        self.delay_s = delay_s
        self._lock = threading.Lock()

    def publish(self, batch_id: str, chunk_no: int, *, lane: str, priority: int) -> None:
        if self.fail:
            raise PublishError("broker down")
        time.sleep(self.delay_s)  # a broker round trip: lets dispatchers overlap
        with self._lock:
            self.sent.append((batch_id, chunk_no))


def _settings(tmp_path: Path) -> Settings:
    return Settings(  # type: ignore[call-arg]
        _env_file=None, data_dir=tmp_path, chunk_lines=10, batch_tenant_window_chunks=WINDOW
    )


def _service(database_url: str, tmp_path: Path, publisher: RecordingPublisher | None) -> BatchService:
    return BatchService(
        store=Store.from_url(database_url),
        files=LocalFileStore(tmp_path / "files", max_bytes=10_000_000),
        fleet=parse_fleet(FLEET),
        settings=_settings(tmp_path),
        publisher=publisher,
        clock=ManualClock(start=T0),
    )


@pytest.fixture
def svc(database_url: str, tmp_path: Path) -> Iterator[BatchService]:
    # Submissions publish nothing here, so that each test runs the dispatcher when it says.
    service = _service(database_url, tmp_path, None)
    yield service
    service.store.dispose()


async def _chunks(data: bytes) -> Any:
    yield data


async def _submit(svc: BatchService, tenant: str, lines: int, **metadata: str) -> str:
    f = await svc.upload_file(tenant, filename="in.jsonl", purpose="batch", chunks=_chunks(chat_lines(lines)))
    return svc.create_batch(
        tenant,
        BatchCreate(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=metadata or None,
        ),
    ).id


def _finish(svc: BatchService, *chunks: tuple[str, int]) -> None:
    """Chunks a worker finished (what it writes when a chunk is done)."""
    with svc.store.session() as s:
        for bid, no in chunks:
            s.connection().execute(
                text("UPDATE tidal_batch_chunks SET state = 'done' WHERE batch_id = :b AND chunk_no = :c"),
                {"b": bid, "c": no},
            )


def _in_flight(store: Store) -> dict[str, int]:
    with store.session() as s:
        rows = s.connection().execute(
            text(
                """SELECT b.tenant, COUNT(*) FROM tidal_batch_chunks c JOIN tidal_batches b ON b.id = c.batch_id
                    WHERE c.state IN ('publishing', 'queued', 'running') GROUP BY b.tenant"""
            )
        )
        return {str(t): int(n) for t, n in rows}


def _top_up(svc: BatchService, publisher: RecordingPublisher) -> list[tuple[str, int]]:
    before = len(publisher.sent)
    top_up(svc.store, publisher, svc.windows)
    return publisher.sent[before:]


pytestmark = pytest.mark.anyio


async def test_tenants_take_turns_within_a_priority_level_and_keep_to_their_window(
    svc: BatchService,
) -> None:
    # Given three tenants' batches at the same priority, the first one large
    a = await _submit(svc, "t-a", 90)
    b = await _submit(svc, "t-b", 30)
    c = await _submit(svc, "t-c", 20)
    pub = RecordingPublisher()
    # When the windows are topped up
    sent = _top_up(svc, pub)
    # Then one chunk per tenant in turn, each tenant's in batch order, two each (the window)
    assert sent == [(a, 0), (b, 0), (c, 0), (a, 1), (b, 1), (c, 1)]
    assert _in_flight(svc.store) == {"t-a": 2, "t-b": 2, "t-c": 2}
    # And nothing more goes out while every window is full
    assert _top_up(svc, pub) == []
    # When one of t-a's chunks finishes, t-a alone gets one more
    _finish(svc, (a, 0))
    assert _top_up(svc, pub) == [(a, 2)]
    # When t-a and t-b both have room, t-b goes first: t-a was served more recently
    _finish(svc, (a, 1), (b, 0))
    assert _top_up(svc, pub) == [(b, 2), (a, 3)]


async def test_the_most_urgent_priority_goes_first_across_and_within_tenants(svc: BatchService) -> None:
    # Given t-a's batch at priority 1, and t-b's at priority 1 then a later one at 9
    a = await _submit(svc, "t-a", 50, priority="1")
    b_low = await _submit(svc, "t-b", 50, priority="1")
    b_high = await _submit(svc, "t-b", 10, priority="9")
    pub = RecordingPublisher()
    # Then t-b's urgent chunk is in its window and published first; then the tenants take turns
    assert _top_up(svc, pub) == [(b_high, 0), (a, 0), (b_low, 0), (a, 1)]
    # When t-a submits an urgent batch while its window is full of less urgent chunks
    a_high = await _submit(svc, "t-a", 20, priority="9")
    assert _top_up(svc, pub) == []
    # Then its urgent chunks take the room as soon as there is some, before its earlier batch
    _finish(svc, (a, 0))
    assert _top_up(svc, pub) == [(a_high, 0)]
    _finish(svc, (a, 1), (a_high, 0))
    assert _top_up(svc, pub) == [(a_high, 1), (a, 2)]


async def test_max_lines_in_flight_is_the_window_and_a_larger_chunk_still_runs_alone(
    svc: BatchService,
) -> None:
    wide = await _submit(svc, "wide", 60)  # max_lines_in_flight 25: two chunks of 10
    narrow = await _submit(svc, "narrow", 30)  # max_lines_in_flight 5: a chunk of 10 alone
    pub = RecordingPublisher()
    assert set(_top_up(svc, pub)) == {(narrow, 0), (wide, 0), (wide, 1)}
    assert _in_flight(svc.store) == {"wide": 2, "narrow": 1}
    _finish(svc, (narrow, 0), (wide, 0))
    assert set(_top_up(svc, pub)) == {(narrow, 1), (wide, 2)}
    assert tenant_windows(svc.fleet, svc.settings)("somebody") == Window(chunks=WINDOW)
    assert tenant_windows(svc.fleet, svc.settings)("wide") == Window(lines=25)


async def test_a_broker_failure_leaves_the_chunks_pending_and_the_window_free(svc: BatchService) -> None:
    a = await _submit(svc, "t-a", 30)
    assert top_up(svc.store, RecordingPublisher(fail=True), svc.windows) == 0
    assert _in_flight(svc.store) == {}
    assert _top_up(svc, RecordingPublisher()) == [(a, 0), (a, 1)]


async def test_the_sweep_tops_up_and_cancelling_frees_the_window(svc: BatchService) -> None:
    first = await _submit(svc, "t-a", 40)
    second = await _submit(svc, "t-a", 20)
    pub = RecordingPublisher()
    sweeper = BatchMaintenance(svc.store, svc.files, clock=svc.clock, publisher=pub, windows=svc.windows)
    assert sweeper.sweep()["published"] == WINDOW
    assert pub.sent == [(first, 0), (first, 1)]
    # When the tenant cancels the first batch, its queued chunks no longer hold the window
    svc.publisher = pub
    svc.cancel_batch("t-a", first)
    assert pub.sent[2:] == [(second, 0), (second, 1)]
    with pytest.raises(ValueError, match="windows"):
        BatchMaintenance(svc.store, svc.files, clock=svc.clock, publisher=pub)


@pytest.mark.parametrize("dispatchers", [2, 6])
async def test_concurrent_dispatchers_never_pass_a_window(
    database_url: str, tmp_path: Path, dispatchers: int
) -> None:
    # Given two tenants with many chunks, and several dispatchers on their own connections (two
    # gateways and workers topping up at once) while a worker finishes chunks
    stores = [_service(database_url, tmp_path, None) for _ in range(dispatchers)]
    svc = stores[0]
    a = await _submit(svc, "t-a", 200)
    b = await _submit(svc, "t-b", 150)
    total = 35
    publishers = [RecordingPublisher(delay_s=0.002) for _ in stores]
    stop = threading.Event()
    errors: list[BaseException] = []
    worst: dict[str, int] = {}

    def dispatch(i: int) -> None:
        try:
            while not stop.is_set():
                top_up(stores[i].store, publishers[i], stores[i].windows)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            stop.set()

    def work() -> None:
        rng = random.Random(7)
        try:
            while not stop.is_set():
                now = _in_flight(svc.store)
                for tenant, n in now.items():
                    worst[tenant] = max(worst.get(tenant, 0), n)
                with svc.store.session() as s:
                    queued = (
                        s.connection()
                        .execute(
                            text("SELECT batch_id, chunk_no FROM tidal_batch_chunks WHERE state = 'queued'")
                        )
                        .all()
                    )
                if queued:
                    _finish(svc, tuple(rng.choice(queued)))  # type: ignore[arg-type]
                with svc.store.session() as s:
                    left = (
                        s.connection()
                        .execute(text("SELECT COUNT(*) FROM tidal_batch_chunks WHERE state != 'done'"))
                        .scalar_one()
                    )
                if left == 0:
                    stop.set()
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=dispatch, args=(i,)) for i in range(dispatchers)]
    threads.append(threading.Thread(target=work))
    for t in threads:
        t.start()
    stop.wait(120)
    stop.set()
    for t in threads:
        t.join(30)
    for s in stores:
        s.store.dispose()
    assert not errors, errors
    # Then no tenant ever had more than its window in flight, and each chunk went out once
    assert worst == {"t-a": WINDOW, "t-b": WINDOW}
    sent = [x for p in publishers for x in p.sent]
    assert len(sent) == total and len(set(sent)) == total
    assert {x for x in sent if x[0] == a} == {(a, n) for n in range(20)}
    assert {x for x in sent if x[0] == b} == {(b, n) for n in range(15)}


# -- max_lines_queued ------------------------------------------------------------------------------


async def test_a_submission_past_max_lines_queued_is_refused_and_creates_nothing(svc: BatchService) -> None:
    # Given acme (max_lines_queued 100) with 60 lines in an unfinished batch
    first = await _submit(svc, "acme", 60)
    # When it submits 50 more
    with pytest.raises(LimitExceeded) as refused:
        await _submit(svc, "acme", 50)
    # Then it is refused with 429, the limit and the count named, and what to do
    exc = refused.value
    assert exc.status == 429 and exc.code == "max_lines_queued_exceeded"
    assert "50 lines" in exc.message and "already hold 60" in exc.message
    assert "limit of 100 queued lines (max_lines_queued)" in exc.message
    assert "Wait for some of them to finish" in exc.message
    with svc.store.session() as s:
        assert s.connection().execute(text("SELECT COUNT(*) FROM tidal_batches")).scalar_one() == 1
    # And up to the limit is accepted; another tenant is not bounded by acme's limit
    await _submit(svc, "acme", 40)
    await _submit(svc, "t-b", 500)
    # And a batch larger than the limit says it must be split
    svc.cancel_batch("acme", first)
    with pytest.raises(LimitExceeded, match="split it"):
        await _submit(svc, "acme", 101)


async def test_racing_submissions_cannot_both_pass_max_lines_queued(
    database_url: str, tmp_path: Path
) -> None:
    # Given eight gateways, each about to submit 60 lines of acme's (max_lines_queued 100)
    gateways = [_service(database_url, tmp_path, None) for _ in range(8)]
    files = []
    for g in gateways:
        f = await g.upload_file("acme", filename="in.jsonl", purpose="batch", chunks=_chunks(chat_lines(60)))
        files.append(f.id)
    start = threading.Barrier(len(gateways))
    outcomes: list[str] = []

    def submit(i: int) -> None:
        params = BatchCreate(input_file_id=files[i], endpoint="/v1/chat/completions", completion_window="24h")
        start.wait()
        try:
            gateways[i].create_batch("acme", params)
            outcomes.append("accepted")
        except LimitExceeded:
            outcomes.append("refused")

    # When they submit at once
    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(gateways))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for g in gateways:
        g.store.dispose()
    # Then exactly one is accepted
    assert sorted(outcomes) == ["accepted"] + ["refused"] * 7


async def test_a_job_past_max_lines_queued_is_refused_at_submission(svc: BatchService) -> None:
    import json

    await _submit(svc, "acme", 90)
    data = "".join(json.dumps({"prompt": f"q{i}", "reference": "a"}) + "\n" for i in range(20)).encode()
    f = await svc.upload_file("acme", filename="qa.jsonl", purpose="user_data", chunks=_chunks(data))
    jobs = JobService(svc)
    with pytest.raises(LimitExceeded, match="max_lines_queued"):
        jobs.create_job(
            "acme", JobCreate(kind="eval", input_file_id=f.id, model="tiny", options={"scorer": "contains"})
        )


def test_the_gateway_answers_429_in_openai_shape(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, data_dir=tmp_path, broker_url="memory://")  # type: ignore[call-arg]
    keys = KeyStore()
    keys.add_key("key-acme", Principal("acme", frozenset({"*"})))
    with TestClient(create_app(parse_fleet(FLEET), settings, keys=keys)) as tc:
        client = openai_client(tc, "key-acme")

        def create(n: int) -> Any:
            f = client.files.create(file=("in.jsonl", chat_lines(n)), purpose="batch")
            return client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )

        assert create(80).status == "in_progress"
        with pytest.raises(openai.RateLimitError) as refused:
            create(30)
        assert refused.value.status_code == 429
        body = refused.value.body
        assert isinstance(body, dict)
        assert body["code"] == "max_lines_queued_exceeded" and body["type"] == "rate_limit_error"
        assert "already hold 80" in body["message"] and "limit of 100" in body["message"]
        assert len(client.batches.list().data) == 1
