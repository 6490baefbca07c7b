"""Data residency in the batch tier end to end: the `openai` SDK against the gateway, real
RabbitMQ, real PostgreSQL, a `tidal worker` process and two simulated replicas in two regions.

A batch of a feature kept to eu-west runs every line on the eu-west replica; a batch without one
spreads over both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.batch_tier import (
    BatchTier,
    chat_lines,
    openai_client,
    postgres_database,
    require_postgres,
    require_rabbitmq,
    running_tier,
    wait_for,
)
from tidal.replicas.launcher import ReplicaProcess, sim_process
from tidal.replicas.wire.prom import parse_samples

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[dict[str, ReplicaProcess]]:
    args = ["--served-model-name", "tiny"]
    procs = {
        r: sim_process("fast-test", name=r, args=args, log_path=tmp_path / f"{r}.log") for r in ("us", "eu")
    }
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready(60)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture
def tier(tmp_path: Path, sims: dict[str, ReplicaProcess]) -> Iterator[BatchTier]:
    require_rabbitmq()
    require_postgres()

    def pool(region: str) -> dict[str, Any]:
        return {
            "kind": "batch",
            "model": "tiny",
            "region": region,
            "batch_concurrency_per_replica": 8,
            "replicas": [{"name": f"{region}-0", "url": sims[region[:2]].url}],
        }

    fleet = {
        "models": [{"name": "tiny", "max_model_len": 4096}],
        "pools": {"us-batch": pool("us-east"), "eu-batch": pool("eu-west")},
        "features": {"default": {}, "gdpr": {"regions": ["eu-west"]}},
    }
    with postgres_database() as url, running_tier(tmp_path, url, fleet) as t:
        yield t


def _batch_lines(sim: ReplicaProcess) -> float:
    body = httpx.get(sim.url + "/metrics", timeout=10).text
    return sum(
        s.value
        for s in parse_samples(body)
        if s.name == "tidal_sim_requests_total" and s.labels.get("kind") == "batch"
    )


def _run(client: Any, data: bytes, **metadata: str) -> Any:
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata or None,
    )
    return wait_for(
        lambda: (
            (b := client.batches.retrieve(batch.id)).status in ("completed", "failed", "expired", "cancelled")
            and b
        ),
        120,
        f"batch {batch.id} to finish",
    )


def test_a_batch_of_a_resident_feature_runs_only_in_its_regions(
    tier: BatchTier, sims: dict[str, ReplicaProcess]
) -> None:
    tier.start_worker("reserved", concurrency=2)
    with tier.gateway() as gw:
        client = openai_client(gw)
        # Given a batch pool in us-east and one in eu-west, When a gdpr (eu-west) batch runs
        done = _run(client, chat_lines(60, max_tokens=4), feature="gdpr")
        # Then every line was answered, each on the eu-west replica
        assert done.status == "completed" and done.request_counts.completed == 60
        assert _batch_lines(sims["eu"]) == 60 and _batch_lines(sims["us"]) == 0
        # while a batch of no such feature spreads over both regions
        other = _run(client, chat_lines(60, max_tokens=4, prefix="o"))
        assert other.status == "completed"
        assert _batch_lines(sims["us"]) > 0 and _batch_lines(sims["eu"]) + _batch_lines(sims["us"]) == 120
