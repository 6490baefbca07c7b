"""The batch tier end to end: the `openai` SDK against the gateway, real RabbitMQ, real
PostgreSQL, `tidal worker` processes and real vLLM CPU replicas.

Every scenario checks the same invariant: each ``custom_id`` appears exactly once across the
output and error files, whatever happened to workers and broker on the way.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine, text

from tests.batch_tier import (
    RABBIT_URL,
    BatchTier,
    chat_lines,
    openai_client,
    postgres_database,
    read_jsonl,
    require_postgres,
    require_rabbitmq,
    running_tier,
    tiny_fleet,
    wait_for,
)
from tidal.priority.queues import Topology, queue_depths
from tidal.replicas.launcher import free_port
from tidal.workers.runtime import RUNTIME_REPLICAS_TTL_S

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.vllm]

TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture
def tier(tmp_path: Path, vllm_urls: list[str]) -> Iterator[BatchTier]:
    require_rabbitmq()
    require_postgres()
    with postgres_database() as url, running_tier(tmp_path, url, tiny_fleet(vllm_urls)) as t:
        yield t


def _submit(client: openai.OpenAI, data: bytes, **metadata: str) -> Any:
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata or None,
    )


def _wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    return wait_for(
        lambda: (b := client.batches.retrieve(batch_id)).status in TERMINAL and b,
        timeout,
        f"batch {batch_id} to finish",
    )


def _done(client: openai.OpenAI, batch_id: str) -> int:
    c = client.batches.retrieve(batch_id).request_counts
    return c.completed + c.failed


def _results(client: openai.OpenAI, batch: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    out = read_jsonl(client.files.content(batch.output_file_id).text) if batch.output_file_id else []
    err = read_jsonl(client.files.content(batch.error_file_id).text) if batch.error_file_id else []
    return out, err


def _assert_exactly_once(
    client: openai.OpenAI, batch: Any, n: int, prefix: str = "r"
) -> tuple[list[Any], list[Any]]:
    out, err = _results(client, batch)
    ids = [o["custom_id"] for o in out] + [e["custom_id"] for e in err]
    assert len(ids) == n, f"{len(ids)} results for {n} lines"
    assert sorted(ids) == sorted(f"{prefix}{i}" for i in range(n))
    assert batch.request_counts.total == n
    assert batch.request_counts.completed == len(out) and batch.request_counts.failed == len(err)
    return out, err


def _chunk_deliveries(tier: BatchTier, batch_id: str) -> list[int]:
    engine = create_engine(tier.database_url)
    try:
        with engine.connect() as c:
            return [
                r[0]
                for r in c.execute(
                    text("SELECT deliveries FROM tidal_batch_chunks WHERE batch_id = :b ORDER BY chunk_no"),
                    {"b": batch_id},
                )
            ]
    finally:
        engine.dispose()


def test_a_2000_line_batch_completes_with_every_custom_id_once(tier: BatchTier) -> None:
    # Given workers on two lanes and a gateway
    tier.start_workers(["reserved", "shared"], concurrency=3)
    with tier.gateway() as gw:
        client = openai_client(gw)
        # When a 2,000-line batch is submitted with the openai SDK
        batch = _submit(client, chat_lines(2000))
        assert batch.status == "in_progress"
        final = _wait_final(client, batch.id)
        # Then every line is answered exactly once, with usage accounted
        assert final.status == "completed"
        out, err = _assert_exactly_once(client, final, 2000)
        assert not err and final.error_file_id is None
        assert out[0]["response"]["status_code"] == 200
        assert out[0]["response"]["request_id"].startswith(f"batch-{batch.id}-")
        assert final.usage.output_tokens == 2 * 2000
        assert final.completed_at >= final.in_progress_at >= final.created_at


def test_workers_killed_mid_chunk_with_sigterm_and_sigkill_lose_nothing(tier: BatchTier) -> None:
    # Given two reserved workers draining a 2,000-line batch with longer lines
    a, b = tier.start_workers(["reserved", "reserved"], concurrency=3)
    with tier.gateway() as gw:
        client = openai_client(gw)
        batch = _submit(client, chat_lines(2000, max_tokens=24))
        # When one gets a spot notice (SIGTERM) mid-chunk
        wait_for(lambda: _done(client, batch.id) >= 200, 60, "work to start")
        a.signal(signal.SIGTERM)
        a.proc.wait(30)
        assert "released (preempted)" in a.log(), a.log()[-3000:]
        # And the other is killed outright (SIGKILL) mid-chunk
        wait_for(lambda: _done(client, batch.id) >= 700, 90, "more work")
        b.signal(signal.SIGKILL)
        b.proc.wait(10)
        # And replacements on other lanes take over
        tier.start_workers(["spot", "shared"], concurrency=3)
        final = _wait_final(client, batch.id, timeout=180)
        # Then the batch completes and each line counts once
        assert final.status == "completed"
        _assert_exactly_once(client, final, 2000)
        # And the interrupted chunks were delivered again
        assert max(_chunk_deliveries(tier, batch.id)) >= 2


def test_a_higher_priority_batch_submitted_later_finishes_first(tier: BatchTier) -> None:
    # Given a busy lane: one worker, one chunk at a time, small chunks
    tier.extra_env["TIDAL_CHUNK_LINES"] = "10"
    tier.start_worker("reserved", concurrency=1)
    with tier.gateway() as gw:
        client = openai_client(gw)
        low = _submit(client, chat_lines(200, max_tokens=8, prefix="low"), priority="0")
        wait_for(lambda: _done(client, low.id) >= 10, 60, "the low-priority batch to start")
        # When an urgent batch arrives later
        high = _submit(client, chat_lines(20, max_tokens=8, prefix="high"), priority="9")
        high_final = _wait_final(client, high.id)
        # Then it finishes while the earlier one still has most of its work left
        low_now = client.batches.retrieve(low.id)
        assert high_final.status == "completed"
        assert low_now.status == "in_progress"
        assert low_now.request_counts.completed + low_now.request_counts.failed <= 120
        assert _wait_final(client, low.id).status == "completed"


def test_cancel_keeps_partial_results(tier: BatchTier) -> None:
    tier.start_worker("reserved", concurrency=2)
    with tier.gateway() as gw:
        client = openai_client(gw)
        batch = _submit(client, chat_lines(1500, max_tokens=24))
        wait_for(lambda: _done(client, batch.id) >= 100, 60, "some lines to finish")
        # When the batch is cancelled mid-way
        assert client.batches.cancel(batch.id).status == "cancelling"
        final = _wait_final(client, batch.id, timeout=30)
        # Then it is cancelled with the finished lines in the output and the rest accounted for
        assert final.status == "cancelled" and final.cancelled_at is not None
        out, err = _assert_exactly_once(client, final, 1500)
        assert 100 <= len(out) < 1500
        assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
        # And nothing is written afterwards
        time.sleep(1.5)
        assert client.batches.retrieve(batch.id).request_counts.completed == len(out)


def test_pausing_the_shared_lane_stops_it_within_seconds_and_resume_finishes(tier: BatchTier) -> None:
    from tidal.workers.control import LaneSwitch

    topo = Topology(tier.namespace)
    tier.start_worker("shared", concurrency=2)
    switch = LaneSwitch(tier.settings())
    try:
        with tier.gateway() as gw:
            client = openai_client(gw)
            batch = _submit(client, chat_lines(1200, max_tokens=32))
            wait_for(lambda: _done(client, batch.id) >= 50, 60, "shared-lane work to start")
            # When the scheduler pauses the shared lane (persisted state, in-flight abort, consumers)
            t0 = time.monotonic()
            ack = switch.pause("shared", "test: interactive queue wait over budget")
            # Then the pause is confirmed quickly and no line finishes any more
            assert ack.confirmed and ack.workers, ack
            assert ack.elapsed_s < 2.0
            time.sleep(1.0)
            frozen = _done(client, batch.id)
            time.sleep(2.0)
            assert _done(client, batch.id) == frozen
            assert frozen < 1200
            assert time.monotonic() - t0 < 6
            assert queue_depths(url=RABBIT_URL, topology=topo)["shared"] > 0  # the rest waits, requeued
            # And a worker that starts while the lane is paused does not consume it either
            late = tier.start_worker("shared", concurrency=2)
            time.sleep(3.0)
            assert _done(client, batch.id) == frozen, late.log()[-2000:]
            # When the lane resumes, every worker consumes again and the batch completes once
            resumed = switch.resume("shared")
            assert resumed.confirmed and len(resumed.workers) == 2, resumed
            final = _wait_final(client, batch.id)
            assert final.status == "completed"
            _assert_exactly_once(client, final, 1200)
    finally:
        switch.close()


def test_a_chunk_past_the_delivery_limit_dead_letters_into_the_error_file(tier: BatchTier) -> None:
    import pika

    from tidal.priority.queues import pika_parameters

    tier.extra_env["TIDAL_DELIVERY_LIMIT"] = "2"
    with tier.gateway() as gw:
        client = openai_client(gw)
        batch = _submit(client, chat_lines(120))
        # Given chunk 1 was already delivered twice to workers that died with it
        engine = create_engine(tier.database_url)
        with engine.begin() as c:
            c.execute(
                text("UPDATE tidal_batch_chunks SET deliveries = 2 WHERE batch_id = :b AND chunk_no = 1"),
                {"b": batch.id},
            )
        engine.dispose()
        # When a worker receives it again
        metrics_port = free_port()
        tier.start_worker("reserved", concurrency=2, metrics_port=metrics_port)
        final = _wait_final(client, batch.id)
        # Then its lines are in the error file with the reason, the rest succeeded
        out, err = _assert_exactly_once(client, final, 120)
        assert sorted(e["custom_id"] for e in err) == sorted(f"r{i}" for i in range(50, 100))
        assert {e["error"]["code"] for e in err} == {"delivery_limit_exceeded"}
        # And the message itself sits in the dead-letter queue
        conn = pika.BlockingConnection(pika_parameters(RABBIT_URL))
        try:
            depth = conn.channel().queue_declare(Topology(tier.namespace).dead_letter_queue, passive=True)
            assert depth.method.message_count == 1
        finally:
            conn.close()
        # And the worker counted it, for the TidalDeadLetteredChunks alert
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        counted = [ln for ln in metrics.splitlines() if ln.startswith("tidal_worker_chunks_total{")]
        assert 'tidal_worker_chunks_total{lane="reserved",outcome="dead_lettered"} 1.0' in counted, counted


def test_work_for_a_pool_without_replicas_waits_in_the_queue(tier: BatchTier) -> None:
    # Given a pool whose replicas are not there (scaled to zero, not registered yet)
    tier.fleet["pools"]["empty"] = {"kind": "batch", "model": "tiny", "replicas": []}
    tier.write_fleet()
    tier.start_worker("reserved", concurrency=1)
    with tier.gateway({"key-admin": ("ops", True)}) as gw:
        client = openai_client(gw, "key-admin")
        # When a batch is pinned to it
        batch = _submit(client, chat_lines(20), pool="empty")
        # Then nothing fails: its chunk keeps going back to the queue
        wait_for(lambda: max(_chunk_deliveries(tier, batch.id)) >= 2, 30, "a redelivery")
        assert client.batches.retrieve(batch.id).request_counts.failed == 0
        # And cancelling it accounts for every line
        client.batches.cancel(batch.id)
        final = _wait_final(client, batch.id, timeout=30)
        _, err = _assert_exactly_once(client, final, 20)
        assert {e["error"]["code"] for e in err} == {"batch_cancelled"}


def test_a_replica_registered_at_run_time_takes_its_pools_batch_work(
    tier: BatchTier, vllm_urls: list[str]
) -> None:
    # Given a pool with no replica in the fleet file (the autoscaler starts them), and its worker
    tier.fleet["pools"]["elastic"] = {"kind": "batch", "model": "tiny", "replicas": []}
    tier.write_fleet()
    tier.start_worker("reserved", concurrency=2)
    with tier.gateway({"key-admin": ("ops", True)}) as gw:
        client = openai_client(gw, "key-admin")
        batch = _submit(client, chat_lines(30), pool="elastic")
        wait_for(lambda: max(_chunk_deliveries(tier, batch.id)) >= 2, 30, "a redelivery")
        assert _done(client, batch.id) == 0
        # When a replica is registered with the gateway at run time, as the local actuator does
        admin = {"Authorization": "Bearer key-admin"}
        r = gw.post(
            "/admin/replicas",
            headers=admin,
            json={"name": "elastic-0", "url": vllm_urls[0], "pool": "elastic"},
        )
        assert r.status_code == 201, r.text
        # Then the worker finds it and the waiting batch completes there, each line once
        final = _wait_final(client, batch.id, timeout=120)
        assert final.status == "completed"
        _assert_exactly_once(client, final, 30)
        # And deregistering it forgets it for the workers too: new work for the pool waits again
        assert gw.delete("/admin/replicas/elastic-0", headers=admin).json()["removed"] is True
        time.sleep(RUNTIME_REPLICAS_TTL_S + 0.5)  # the worker's list of them may be this stale
        later = _submit(client, chat_lines(10), pool="elastic")
        wait_for(lambda: max(_chunk_deliveries(tier, later.id)) >= 2, 30, "a redelivery")
        assert _done(client, later.id) == 0
        client.batches.cancel(later.id)
        _wait_final(client, later.id, timeout=30)
