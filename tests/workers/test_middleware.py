"""Chunk middleware: hook order, isolation of failures, and each policy's decisions."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tidal.logs import REQUEST_ID, JsonFormatter, RequestIdFilter
from tidal.replicas.client import ReplicaClient
from tidal.replicas.errors import ReplicaRequestError, ReplicaServerError, ReplicaTimeout, ReplicaUnavailable
from tidal.workers.chunk import ChunkContext, ChunkOutcome, ChunkWork, ReplicaSet, ReplicaSlot
from tidal.workers.middleware import (
    AccessLog,
    Attempt,
    ChunkMiddleware,
    LaneGate,
    LanePause,
    Metrics,
    OutgoingRequest,
    PriorityMapping,
    Retries,
    emit_after,
    emit_before,
)
from tidal.workers.runtime import governed_queues, lane_of_hostname

pytestmark = pytest.mark.anyio


def _ctx(lane: str = "shared", priority: int = 9, endpoint: str = "/v1/chat/completions") -> ChunkContext:
    work = ChunkWork("batch_x", 0, lane, priority, endpoint, [])
    return ChunkContext(work, asyncio.get_running_loop())


def _req(custom_id: str = "c1") -> OutgoingRequest:
    return OutgoingRequest(1, custom_id, {"model": "tiny", "messages": []})


async def test_before_hooks_run_in_order_after_hooks_in_reverse_and_failures_are_isolated() -> None:
    seen: list[str] = []

    class Rec(ChunkMiddleware):
        def __init__(self, name: str) -> None:
            self.name = name

        def before_chunk(self, ctx: ChunkContext) -> None:
            seen.append(f"before {self.name}")

        def after_chunk(self, ctx: ChunkContext, outcome: ChunkOutcome) -> None:
            seen.append(f"after {self.name}")

    class Broken(ChunkMiddleware):
        def before_chunk(self, ctx: ChunkContext) -> None:
            raise RuntimeError("bug in a middleware")

    chain: list[ChunkMiddleware] = [Rec("a"), Broken(), Rec("b")]
    ctx = _ctx()
    emit_before(chain, "chunk", ctx)
    emit_after(chain, "chunk", ctx, ChunkOutcome("done"))
    assert seen == ["before a", "before b", "after b", "after a"]


@pytest.mark.parametrize(
    ("priority", "endpoint", "vllm_priority"),
    [
        (9, "/v1/chat/completions", 100),
        (0, "/v1/chat/completions", 109),
        (5, "/v1/completions", 104),
        (9, "/v1/embeddings", None),
    ],
)
async def test_priority_mapping(priority: int, endpoint: str, vllm_priority: int | None) -> None:
    req = _req("weird id/with spaces\r\nX: y")
    PriorityMapping().before_request(_ctx(priority=priority, endpoint=endpoint), req)
    assert req.body.get("priority") == vllm_priority
    # A recognisable request id that cannot smuggle headers
    assert req.headers["X-Request-Id"] == "batch-batch_x-weird_id_with_spaces__X__y"


@pytest.mark.parametrize(
    ("error", "attempt", "retried"),
    [
        (ReplicaUnavailable("refused", replica="r0"), 0, True),
        (ReplicaTimeout("slow", replica="r0"), 1, True),
        (ReplicaServerError("500", status=500, replica="r0"), 2, True),
        (ReplicaUnavailable("refused", replica="r0"), 3, False),  # out of attempts
        (ReplicaRequestError("bad request", status=400, replica="r0"), 0, False),  # the request is wrong
        (None, 0, False),
    ],
)
async def test_retries_go_elsewhere_with_backoff(
    error: Exception | None, attempt: int, retried: bool
) -> None:
    req = _req()
    req.attempt = attempt
    Retries(max_attempts=4, min_backoff_s=0.2, seed=1).after_request(_ctx(), req, Attempt("r0", error=error))  # type: ignore[arg-type]
    assert (req.retry_in is not None) == retried
    if retried:
        assert req.avoid == {"r0"}
        assert 0.1 * 2**attempt <= (req.retry_in or 0) <= 0.2 * 2**attempt


async def test_a_paused_lane_stops_its_running_chunks_only() -> None:
    gate = LaneGate()
    shared, reserved = _ctx("shared"), _ctx("reserved")
    mw = LanePause(gate)
    mw.before_chunk(shared)
    mw.before_chunk(reserved)
    # When the shared lane pauses
    assert gate.apply("shared", True, "test")
    await asyncio.sleep(0)
    # Then only its chunk stops, aborting in-flight lines, and will be requeued
    assert shared.stop_reason == "paused" and shared.abort and shared.requeue
    assert reserved.stop_reason is None
    # And a chunk of a paused lane does not even start
    late = _ctx("shared")
    mw.before_chunk(late)
    assert late.stop_reason == "paused"
    assert not gate.apply("shared", True)  # no change


@pytest.mark.parametrize(
    ("worker_lane", "paused", "queues"),
    [
        ("shared", "shared", ["shared"]),
        ("reserved", "shared", []),  # reserved workers drain `any` work on their own replicas
        ("reserved", "reserved", ["reserved", "shared"]),
        ("all", "shared", ["shared"]),
        ("spot", "reserved", []),
    ],
)
def test_which_queues_a_pause_stops(worker_lane: str, paused: str, queues: list[str]) -> None:
    assert governed_queues(worker_lane, paused) == queues
    assert lane_of_hostname(f"{worker_lane}@host-12") == worker_lane


async def test_metrics_count_lines_and_chunks() -> None:
    m = Metrics()
    ctx = _ctx()
    m.before_chunk(ctx)
    for attempt in (Attempt("r0", status=200), Attempt("r0", status=400), Attempt("r0", aborted=True)):
        m.before_request(ctx, _req())
        m.after_request(ctx, _req(), attempt)
    m.after_chunk(ctx, ChunkOutcome("released", "paused"))
    get = m.registry.get_sample_value
    assert get("tidal_worker_lines_total", {"lane": "shared", "result": "ok"}) == 1
    assert get("tidal_worker_lines_total", {"lane": "shared", "result": "http_400"}) == 1
    assert get("tidal_worker_lines_total", {"lane": "shared", "result": "aborted"}) == 1
    assert get("tidal_worker_inflight_lines", {"lane": "shared"}) == 0
    assert get("tidal_worker_chunks_total", {"lane": "shared", "outcome": "released"}) == 1


async def test_a_replica_set_changes_membership_without_losing_busy_slots() -> None:
    a, b, c = (ReplicaSlot(n, ReplicaClient(f"http://127.0.0.1:9/{n}", name=n), 2) for n in "abc")
    rs = ReplicaSet([a, b])
    busy = rs.try_acquire()
    assert busy is a  # both free: the first with the most room
    # A replica registered at run time joins; one deregistered leaves with its line still on it.
    dropped = rs.replace_slots([a, c])
    assert dropped == [b] and rs.slots == [a, c] and a.inflight == 1
    assert {rs.try_acquire(), rs.try_acquire()} <= {a, c}
    rs.release(busy)
    with pytest.raises(ValueError):
        rs.replace_slots([])
    for s in (a, b, c):
        await s.client.aclose()


async def test_the_access_log_names_each_attempt_by_the_request_id_the_replica_got(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx, req = _ctx(), _req("cid/7")
    PriorityMapping().before_request(ctx, req)
    access = AccessLog()
    with caplog.at_level(logging.WARNING, logger="tidal.access"):
        access.after_request(ctx, req, Attempt("r1", status=200, seconds=0.25))
    assert not caplog.records  # off: nothing per line
    with caplog.at_level(logging.INFO, logger="tidal.access"):
        access.after_request(ctx, req, Attempt("r1", status=200, seconds=0.25))
        access.after_request(ctx, req, Attempt("r2", error=ReplicaTimeout("slow", replica="r2")))
    ok, failed = caplog.records
    assert ok.request_id == failed.request_id == "batch-batch_x-cid_7"  # type: ignore[attr-defined]
    assert (ok.batch_id, ok.custom_id, ok.replica, ok.status, ok.duration_ms) == (  # type: ignore[attr-defined]
        "batch_x",
        "cid/7",
        "r1",
        200,
        250.0,
    )
    assert failed.status is None and "slow" in failed.error  # type: ignore[attr-defined]
    line = json.loads(JsonFormatter().format(ok))
    assert line["request_id"] == "batch-batch_x-cid_7" and line["msg"] == "batch line"
    assert "error" not in line  # None fields are left out


def test_json_lines_carry_the_current_request_id_and_the_extra_fields() -> None:
    record = logging.LogRecord("tidal.x", logging.WARNING, __file__, 1, "went %s", ("wrong",), None)
    token = REQUEST_ID.set("tidal-42")
    try:
        assert RequestIdFilter().filter(record)
    finally:
        REQUEST_ID.reset(token)
    record.replica = "r1"
    line = json.loads(JsonFormatter().format(record))
    assert line == {
        "ts": line["ts"],
        "level": "WARNING",
        "logger": "tidal.x",
        "msg": "went wrong",
        "request_id": "tidal-42",
        "replica": "r1",
    }
