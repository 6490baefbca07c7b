"""Chunk execution against real vLLM CPU replicas: concurrency, failover, abort on pause,
grace on preemption, HTTP errors in the error file."""

from __future__ import annotations

import asyncio
import json

import pytest

from tidal.batch_jobs.results import LineResult
from tidal.replicas.client import ReplicaClient
from tidal.replicas.metrics import parse_load_snapshot
from tidal.workers.chunk import ChunkContext, ChunkExecutor, ChunkWork, PendingLine, ReplicaSet, ReplicaSlot
from tidal.workers.middleware import ChunkMiddleware, Metrics, PriorityMapping, Retries

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]


def _lines(n: int, max_tokens: int = 4, **extra: object) -> list[PendingLine]:
    return [
        PendingLine(
            i + 1,
            f"c{i}",
            json.dumps(
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"n {i}"}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    **extra,
                }
            ),
        )
        for i in range(n)
    ]


class Capture(ChunkMiddleware):
    """Holds the running chunk's context, as the pause and preemption middleware do."""

    ctx: ChunkContext | None = None

    def before_chunk(self, ctx: ChunkContext) -> None:
        self.ctx = ctx


class Collector:
    def __init__(self) -> None:
        self.results: list[LineResult] = []

    async def __call__(self, results: list[LineResult]) -> int:
        self.results += results
        return len(results)


def _set(urls: list[str], limit: int = 16) -> ReplicaSet:
    return ReplicaSet(
        [ReplicaSlot(f"r{i}", ReplicaClient(u, name=f"r{i}"), limit) for i, u in enumerate(urls)]
    )


async def _running(url: str) -> float:
    async with ReplicaClient(url) as c:
        snap = parse_load_snapshot(await c.metrics_text())
        return snap.num_running + snap.num_waiting


async def test_every_line_is_answered_with_low_priority_and_a_batch_request_id(vllm_urls: list[str]) -> None:
    metrics = Metrics()
    executor = ChunkExecutor([metrics, PriorityMapping(), Retries()])
    rs = _set(vllm_urls, limit=8)
    rec = Collector()
    outcome = await executor.run(
        ChunkWork("batch_t1", 0, "reserved", 3, "/v1/chat/completions", _lines(40)), rs, rec
    )
    await rs.aclose()
    assert outcome.kind == "done" and outcome.recorded == 40
    assert sorted(r.line_no for r in rec.results) == list(range(1, 41))
    first = next(r for r in rec.results if r.line_no == 1)
    assert first.succeeded and first.output_tokens == 4
    assert first.request_id == "batch-batch_t1-c0"
    assert "batch-batch_t1-c0" in json.loads(first.response_body or "{}")["id"]  # vLLM saw our header
    assert (
        metrics.registry.get_sample_value("tidal_worker_lines_total", {"lane": "reserved", "result": "ok"})
        == 40
    )


async def test_a_dead_replica_fails_over_to_a_live_one(vllm_urls: list[str]) -> None:
    metrics = Metrics()
    executor = ChunkExecutor([metrics, PriorityMapping(), Retries(min_backoff_s=0.01, seed=0)])
    rs = _set(["http://127.0.0.1:1", vllm_urls[0]], limit=4)
    rec = Collector()
    outcome = await executor.run(
        ChunkWork("batch_t2", 0, "spot", 0, "/v1/chat/completions", _lines(12)), rs, rec
    )
    await rs.aclose()
    assert outcome.kind == "done"
    assert len(rec.results) == 12 and all(r.succeeded for r in rec.results)
    assert (metrics.registry.get_sample_value("tidal_worker_retries_total", {"lane": "spot"}) or 0) >= 1


async def test_a_request_the_replica_refuses_goes_to_the_error_file_unretried(vllm_urls: list[str]) -> None:
    executor = ChunkExecutor([PriorityMapping(), Retries(min_backoff_s=0.01)])
    rs = _set(vllm_urls[:1])
    rec = Collector()
    await executor.run(
        ChunkWork("batch_t3", 0, "reserved", 0, "/v1/chat/completions", _lines(1, max_tokens=100_000)),
        rs,
        rec,
    )
    await rs.aclose()
    [r] = rec.results
    assert not r.succeeded and r.status_code == 400 and r.error is None
    assert "error" in json.loads(r.response_body or "{}") or "message" in (r.response_body or "")


async def test_pause_aborts_in_flight_lines_and_releases_the_rest(vllm_urls: list[str]) -> None:
    capture = Capture()
    executor = ChunkExecutor([capture, PriorityMapping()])
    rs = _set(vllm_urls[:1], limit=8)
    rec = Collector()
    work = ChunkWork("batch_t4", 0, "shared", 0, "/v1/chat/completions", _lines(24, max_tokens=3000))
    task = asyncio.ensure_future(executor.run(work, rs, rec))
    # Given long lines are decoding on the replica
    for _ in range(100):
        await asyncio.sleep(0.05)
        if await _running(vllm_urls[0]) >= 4:
            break
    # When the lane pauses (the control message stops the chunk with abort)
    assert capture.ctx is not None
    capture.ctx.stop("paused", abort=True)
    outcome = await asyncio.wait_for(task, 10)
    await rs.aclose()
    # Then nothing more is sent, the in-flight requests are closed and vLLM drops them
    assert outcome.kind == "released" and outcome.reason == "paused"
    assert outcome.remaining == 24 - len(rec.results) and outcome.remaining >= 16
    for _ in range(50):
        if await _running(vllm_urls[0]) == 0:
            break
        await asyncio.sleep(0.1)
    assert await _running(vllm_urls[0]) == 0


async def test_preemption_lets_in_flight_lines_finish_within_the_grace(vllm_urls: list[str]) -> None:
    capture = Capture()
    executor = ChunkExecutor([capture, PriorityMapping()])
    rs = _set(vllm_urls[:1], limit=4)
    rec = Collector()
    work = ChunkWork("batch_t5", 0, "spot", 0, "/v1/chat/completions", _lines(20, max_tokens=48))
    task = asyncio.ensure_future(executor.run(work, rs, rec))
    await asyncio.sleep(0.2)
    assert capture.ctx is not None
    capture.ctx.stop("preempted", grace_s=30)
    outcome = await asyncio.wait_for(task, 40)
    await rs.aclose()
    # The lines that were in flight finished (nothing wasted), the rest is left for redelivery
    assert outcome.kind == "released" and outcome.remaining == 20 - len(rec.results)
    assert 1 <= len(rec.results) < 20 and all(r.succeeded for r in rec.results)
