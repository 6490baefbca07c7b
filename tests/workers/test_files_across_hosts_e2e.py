"""The batch tier across hosts: two ``tidal gateway`` processes and a ``tidal worker`` that share
no disk, only PostgreSQL (the store and, through ``TIDAL_FILES_URL``, the files' bytes) and
RabbitMQ. The `openai` SDK uploads through one gateway and reads the output through the other.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.batch_tier import (
    BatchTier,
    chat_lines,
    postgres_database,
    read_jsonl,
    require_postgres,
    require_rabbitmq,
    running_tier,
    wait_for,
)
from tidal.replicas.launcher import ReplicaProcess, free_port, sim_process

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

DEV_KEY = "dev-key-for-files-tests-0123456789"


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[ReplicaProcess]:
    proc = sim_process(
        "fast-test", name="s0", args=["--served-model-name", "tiny"], log_path=tmp_path / "sim.log"
    )
    proc.start()
    try:
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
        "features": {"default": {}},
    }
    with postgres_database() as url, running_tier(tmp_path / "tier", url, fleet) as t:
        # Every process gets its own (empty) files directory, as on its own host.
        t.extra_env = {"TIDAL_FILES_URL": url, "TIDAL_FILES_DIR": str(tmp_path / "worker-files")}
        yield t


def _gateway(tier: BatchTier, host: Path) -> ReplicaProcess:
    port = free_port()
    env = {
        **tier.env(),
        "TIDAL_DATA_DIR": str(host / "data"),
        "TIDAL_FILES_DIR": str(host / "files"),
        "TIDAL_DEV_API_KEY": DEV_KEY,
    }
    argv = [sys.executable, "-m", "tidal", "gateway", "--config", str(tier.fleet_path), "--port", str(port)]
    return ReplicaProcess(
        host.name, argv, port=port, env=env, log_path=host / "gateway.log", health_path="/healthz"
    )


def _client(gw: ReplicaProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)


def _blobs(url: str) -> int:
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        row = conn.execute("SELECT count(*) FROM tidal_file_blobs").fetchone()
    assert row is not None
    return int(row[0])


def test_a_batch_crosses_gateways_and_a_worker_through_postgres_alone(
    tier: BatchTier, tmp_path: Path
) -> None:
    # Given two gateways and a worker, each with its own files directory, sharing PostgreSQL
    gateways = [_gateway(tier, tmp_path / name) for name in ("host-a", "host-b")]
    for gw in gateways:
        gw.start()
    try:
        tier.start_worker("reserved", concurrency=2)
        for gw in gateways:
            gw.wait_ready(60)
        a, b = (_client(gw) for gw in gateways)
        data = chat_lines(30, max_tokens=3)
        # When a batch's input is uploaded through gateway A and the batch created there
        f = a.files.create(file=("in.jsonl", data), purpose="batch")
        batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert batch.status == "in_progress", batch
        # Then gateway B serves the same input, and sees the batch through to its end
        assert b.files.content(f.id).read() == data
        done = wait_for(
            lambda: (
                (x := b.batches.retrieve(batch.id)).status in ("completed", "failed", "expired", "cancelled")
                and x
            ),
            90,
            f"batch {batch.id} to finish",
        )
        assert done.status == "completed" and done.request_counts.completed == 30, done
        # And the output file the worker (or a gateway's sweep) wrote is read through gateway B
        out = read_jsonl(b.files.content(done.output_file_id).text)
        assert sorted(line["custom_id"] for line in out) == sorted(f"r{i}" for i in range(30))
        assert all(line["response"]["status_code"] == 200 for line in out)
        assert _blobs(tier.database_url) == 2  # the input and the output
        # When B deletes the input, A no longer has it either
        assert b.files.delete(f.id).deleted
        assert _blobs(tier.database_url) == 1
        with pytest.raises(Exception, match="No such file"):
            a.files.content(f.id)
    finally:
        for gw in gateways:
            gw.stop()
    # Nothing passed through any process's local files directory
    for d in (tmp_path / "host-a" / "files", tmp_path / "host-b" / "files", tmp_path / "worker-files"):
        assert not d.exists() or not any(d.rglob("*")), sorted(d.rglob("*"))
