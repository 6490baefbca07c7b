"""Tenants sharing a lane end to end: the `openai` SDK against the gateway, real RabbitMQ, real
PostgreSQL, a `tidal worker` process and a simulated replica.

Tenant A submits a large batch of many small chunks; tenant B submits a small one at the same
priority a moment later. Published all at once, B's chunks would wait behind every one of A's;
published progressively into each tenant's window, B's wait behind at most A's window, so B
finishes long before A, each line of both answered exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.batch_tier import (
    BatchTier,
    chat_lines,
    openai_client,
    postgres_database,
    read_jsonl,
    require_postgres,
    require_rabbitmq,
    running_tier,
    wait_for,
)
from tidal.replicas.launcher import ReplicaProcess, sim_process

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

WINDOW = 6  # chunks of one tenant a lane holds in the broker
CHUNK_LINES = 5
A_LINES = 3000  # 600 chunks
B_LINES = 20  # 4 chunks


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[ReplicaProcess]:
    proc = sim_process(
        "fast-test", name="sim", args=["--served-model-name", "tiny"], log_path=tmp_path / "sim.log"
    )
    try:
        proc.start()
        proc.wait_ready(60)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def tier(tmp_path: Path, sim: ReplicaProcess) -> Iterator[BatchTier]:
    require_rabbitmq()
    require_postgres()
    fleet = {
        "models": [{"name": "tiny", "max_model_len": 4096}],
        "pools": {
            "batch": {
                "kind": "batch",
                "model": "tiny",
                "batch_concurrency_per_replica": 8,
                "replicas": [{"name": "b0", "url": sim.url}],
            }
        },
    }
    with postgres_database() as url, running_tier(tmp_path, url, fleet) as t:
        t.extra_env["TIDAL_CHUNK_LINES"] = str(CHUNK_LINES)
        t.extra_env["TIDAL_BATCH_TENANT_WINDOW_CHUNKS"] = str(WINDOW)
        yield t


def _submit(client: Any, data: bytes) -> Any:
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"priority": "5", "lane": "reserved"},
    )


def _answered_once(client: Any, batch: Any, n: int, prefix: str) -> None:
    out = read_jsonl(client.files.content(batch.output_file_id).text) if batch.output_file_id else []
    err = read_jsonl(client.files.content(batch.error_file_id).text) if batch.error_file_id else []
    assert not err, err[:3]
    assert sorted(o["custom_id"] for o in out) == sorted(f"{prefix}{i}" for i in range(n))


def test_a_small_batch_of_one_tenant_finishes_long_before_a_huge_one_of_another(tier: BatchTier) -> None:
    # Given one worker on the reserved lane, taking two chunks at a time
    tier.start_worker("reserved", concurrency=2)
    with tier.gateway({"key-a": ("tenant-a", False), "key-b": ("tenant-b", False)}) as gw:
        a_client, b_client = openai_client(gw, "key-a"), openai_client(gw, "key-b")
        # When tenant A submits a batch of 600 chunks and tenant B, once A runs, one of 4 chunks
        t0 = time.monotonic()
        a = _submit(a_client, chat_lines(A_LINES, max_tokens=4, prefix="a"))
        wait_for(lambda: a_client.batches.retrieve(a.id).request_counts.completed >= 50, 60, "A to start")
        t_b = time.monotonic()
        b = _submit(b_client, chat_lines(B_LINES, max_tokens=4, prefix="b"))
        done: dict[str, float] = {}
        a_done_when_b_done = -1
        deadline = time.monotonic() + 180
        while len(done) < 2:
            assert time.monotonic() < deadline, f"not finished: {done}"
            for name, client, batch in (("a", a_client, a), ("b", b_client, b)):
                if name in done:
                    continue
                now = client.batches.retrieve(batch.id)
                if now.status in ("completed", "failed", "expired", "cancelled"):
                    assert now.status == "completed", now
                    done[name] = time.monotonic()
                    if name == "b":
                        a_done_when_b_done = a_client.batches.retrieve(a.id).request_counts.completed
            time.sleep(0.2)
        b_took, a_left = done["b"] - t_b, done["a"] - t_b
        print(
            f"\nwindow {WINDOW} chunks of {CHUNK_LINES} lines, worker concurrency 2: "
            f"A ({A_LINES} lines) completed {done['a'] - t0:.1f} s after its submission; "
            f"B ({B_LINES} lines, submitted {t_b - t0:.1f} s later) completed {b_took:.1f} s after "
            f"its submission, when A had {a_done_when_b_done} of {A_LINES} lines done; "
            f"A completed {a_left:.1f} s after B's submission"
        )
        # Then B finished long before A: within a small part of the time A still needed (B's
        # chunks waited behind A's window, not behind its 600 chunks), A then mostly undone
        assert b_took < a_left / 3, (b_took, a_left)
        assert a_done_when_b_done <= A_LINES // 2
        # And every line of both is answered exactly once
        _answered_once(a_client, a_client.batches.retrieve(a.id), A_LINES, "a")
        _answered_once(b_client, b_client.batches.retrieve(b.id), B_LINES, "b")
