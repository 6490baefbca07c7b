"""An embedding backfill end to end on a simulated embedding replica (`tidal sim`, e5-mistral
preset): items to vectors, written as JSONL and as a NumPy file in the same order."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.batch_tier import BatchTier, openai_client, read_jsonl, require_rabbitmq, running_tier, wait_for
from tidal.replicas.launcher import ReplicaProcess, sim_process

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def embedder(tmp_path: Path) -> Iterator[ReplicaProcess]:
    proc = sim_process(
        "e5-mistral-7b-h100",
        name="embed-sim",
        args=["--served-model-name", "e5", "--time-scale", "20"],
        log_path=tmp_path / "sim.log",
    ).start()
    try:
        proc.wait_ready(60)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def tier(tmp_path: Path, embedder: ReplicaProcess) -> Iterator[BatchTier]:
    require_rabbitmq()
    fleet = {
        "models": [{"name": "e5", "embedding": True, "max_model_len": 4096}],
        "pools": {
            "embed": {
                "kind": "batch",
                "model": "e5",
                "batch_concurrency_per_replica": 32,
                "replicas": [{"name": "e0", "url": embedder.url}],
            }
        },
    }
    with running_tier(tmp_path / "tier", f"sqlite:///{tmp_path / 'tidal.db'}", fleet) as t:
        t.start_worker("reserved", concurrency=2)
        yield t


def test_an_embedding_backfill_writes_jsonl_and_npy(tier: BatchTier) -> None:
    rows = [
        {"id": f"doc-{i}", "text": f"document number {i} about {'cats' if i % 2 else 'dogs'}"}
        for i in range(50)
    ]
    rows.append({"id": "doc-dup", "text": rows[0]["text"]})  # equal text, equal vector
    with tier.gateway() as gw:
        client = openai_client(gw)
        f = client.files.create(
            file=("items.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()), purpose="user_data"
        )
        job = client.post(
            "/jobs",
            body={
                "kind": "embedding_backfill",
                "input_file_id": f.id,
                "model": "e5",
                "options": {"items_per_request": 8},
            },
            cast_to=httpx.Response,
        ).json()
        done = wait_for(
            lambda: (
                (j := client.get(f"/jobs/{job['id']}", cast_to=httpx.Response).json())["status"]
                != "in_progress"
                and j
            ),
            60,
            "the backfill",
        )
        assert done["status"] == "completed", done
        assert done["result"]["embedded"] == 51 and done["result"]["failed"] == 0
        lines = read_jsonl(client.files.content(done["output_file_ids"]["embeddings"]).text)
        matrix = np.load(io.BytesIO(client.files.content(done["output_file_ids"]["vectors"]).read()))
        assert [x["id"] for x in lines] == [r["id"] for r in rows]
        assert matrix.dtype == np.float32 and matrix.shape == (51, done["result"]["dimensions"])
        assert np.allclose(matrix[3], np.asarray(lines[3]["embedding"], dtype=np.float32))
        assert np.allclose(matrix[0], matrix[50]) and not np.allclose(matrix[0], matrix[1])
