"""Without RabbitMQ (`tidal up`'s fallback): the embedded filesystem broker still completes
batches on a SQLite store, and a pause still holds through the persisted lane state."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.batch_tier import BatchTier, chat_lines, openai_client, read_jsonl, tiny_fleet, wait_for

pytestmark = pytest.mark.vllm


@pytest.fixture
def tier(tmp_path: Path, vllm_urls: list[str]) -> Iterator[BatchTier]:
    t = BatchTier(
        root=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'tidal.db'}",
        fleet=tiny_fleet(vllm_urls),
        broker_url="filesystem://",
    )
    t.write_fleet()
    try:
        yield t
    finally:
        t.close()


def test_a_batch_completes_on_the_embedded_broker_and_a_pause_holds(tier: BatchTier) -> None:
    from tidal.workers.control import LaneSwitch

    tier.start_worker("all", concurrency=2)
    switch = LaneSwitch(tier.settings())
    try:
        with tier.gateway() as gw:
            client = openai_client(gw)
            f = client.files.create(file=("in.jsonl", chat_lines(600, max_tokens=24)), purpose="batch")
            batch = client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )

            def done() -> int:
                c = client.batches.retrieve(batch.id).request_counts
                return c.completed + c.failed

            wait_for(lambda: done() >= 30, 60, "work to start")
            # When the shared lane is paused (no remote control: the worker polls the store)
            ack = switch.pause("shared", "test", timeout=10.0)
            assert ack.confirmed and ack.workers, ack
            time.sleep(1.0)
            frozen = done()
            time.sleep(2.0)
            assert done() == frozen < 600
            # And resumed
            assert switch.resume("shared", timeout=10.0).confirmed
            final = wait_for(
                lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
                120,
                "completion",
            )
            out = read_jsonl(client.files.content(final.output_file_id).text)
            assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(600))
    finally:
        switch.close()
