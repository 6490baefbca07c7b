"""Jobs end to end on real vLLM CPU replicas: an eval with a report and interval, a judged eval
(two stages), map-reduce summaries, and an eval pinned to a canary replica group."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.batch_tier import (
    BatchTier,
    openai_client,
    postgres_database,
    read_jsonl,
    require_postgres,
    require_rabbitmq,
    running_tier,
    tiny_fleet,
    wait_for,
)
from tidal.replicas.client import ReplicaClient
from tidal.replicas.metrics import parse_load_snapshot

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.vllm]


@pytest.fixture
def tier(tmp_path: Path, vllm_urls: list[str]) -> Iterator[BatchTier]:
    require_rabbitmq()
    require_postgres()
    fleet = tiny_fleet(vllm_urls[:1])
    # The batch pool holds a stable and a canary replica (two replicas when two are running)
    fleet["pools"]["batch"]["replicas"] = [
        {"name": "stable-0", "url": vllm_urls[0], "group": "stable"},
        {"name": "canary-0", "url": vllm_urls[-1], "group": "canary"},
    ]
    with postgres_database() as url, running_tier(tmp_path, url, fleet) as t:
        t.start_worker("reserved", concurrency=4)
        yield t


def _job(client: Any, rows: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    f = client.files.create(file=("ds.jsonl", data), purpose="user_data")
    resp = client.post("/jobs", body={"input_file_id": f.id, "model": "tiny", **body}, cast_to=httpx.Response)
    job: dict[str, Any] = resp.json()
    assert job["status"] == "in_progress", job
    return wait_for(
        lambda: (
            (j := client.get(f"/jobs/{job['id']}", cast_to=httpx.Response).json())["status"] != "in_progress"
            and j
        ),
        120,
        f"job {job['id']}",
    )


def test_an_eval_job_reports_score_interval_and_items(tier: BatchTier) -> None:
    rows = [
        {"id": f"q{i}", "prompt": f"question {i}", "reference": "" if i % 2 == 0 else "zq-never-said-zq"}
        for i in range(20)
    ]
    with tier.gateway() as gw:
        client = openai_client(gw)
        job = _job(client, rows, kind="eval", options={"scorer": "contains", "max_tokens": 8, "priority": 7})
        assert job["status"] == "completed", job
        r = job["result"]
        assert (r["n"], r["scored"], r["correct"]) == (20, 20, 10)
        assert r["score"] == 0.5 and r["ci95"][0] < 0.5 < r["ci95"][1]
        report = json.loads(client.files.content(job["output_file_ids"]["report"]).text)
        assert len(report["items"]) == 20 and report["items"][1]["correct"] is False
        items = read_jsonl(client.files.content(job["output_file_ids"]["results"]).text)
        assert [i["id"] for i in items] == [f"q{i}" for i in range(20)]
        # The job's batch is an ordinary batch of the tenant, with the job's priority
        [batch_id] = job["batch_ids"]
        assert client.batches.retrieve(batch_id).metadata["priority"] == "7"


def test_a_judged_eval_and_map_reduce_summaries_run_their_stages(tier: BatchTier) -> None:
    with tier.gateway() as gw:
        client = openai_client(gw)
        judged = _job(
            client,
            [{"prompt": f"q{i}", "reference": "yes"} for i in range(6)],
            kind="eval",
            options={"scorer": "judge", "judge_model": "tiny", "max_tokens": 4},
        )
        assert judged["status"] == "completed" and len(judged["batch_ids"]) == 2
        assert judged["result"]["scored"] == 6
        long_doc = " ".join(f"Sentence {i} of the report." for i in range(300))
        summ = _job(
            client,
            [{"id": "long", "text": long_doc}, {"id": "short", "text": "Tiny."}],
            kind="summaries",
            options={"max_tokens": 16, "context_cap": 400},
        )
        assert summ["status"] == "completed", summ
        assert len(summ["batch_ids"]) >= 2  # map, then at least one reduce round
        docs = {
            d["id"]: d for d in read_jsonl(client.files.content(summ["output_file_ids"]["summaries"]).text)
        }
        assert (
            docs["long"]["pieces"] > 1
            and docs["long"]["rounds"] >= 2
            and isinstance(docs["long"]["summary"], str)
        )
        assert docs["short"]["rounds"] == 1


async def _finished(url: str) -> float:
    async with ReplicaClient(url) as c:
        return parse_load_snapshot(await c.metrics_text()).requests_finished


def test_an_admin_can_pin_an_eval_to_the_canary_group(tier: BatchTier, vllm_urls: list[str]) -> None:
    if len(set(vllm_urls)) < 2:
        pytest.skip("needs two distinct replicas")
    keys = {"key-a": ("tenant-a", False), "key-admin": ("ops", True)}
    rows = [{"prompt": f"q{i}", "reference": ""} for i in range(12)]
    with tier.gateway(keys) as gw:
        user, admin = openai_client(gw, "key-a"), openai_client(gw, "key-admin")
        # A tenant may not choose replicas
        f = user.files.create(file=("ds.jsonl", b'{"prompt": "q", "reference": ""}\n'), purpose="user_data")
        with pytest.raises(openai.PermissionDeniedError):
            user.post(
                "/jobs",
                body={
                    "kind": "eval",
                    "input_file_id": f.id,
                    "model": "tiny",
                    "options": {"replica_group": "canary"},
                },
                cast_to=httpx.Response,
            )
        # An admin (the canary controller) runs the eval on the canary replicas only
        before = [asyncio.run(_finished(u)) for u in vllm_urls[:2]]
        job = _job(
            admin,
            rows,
            kind="eval",
            options={"scorer": "contains", "replica_group": "canary", "max_tokens": 2},
        )
        after = [asyncio.run(_finished(u)) for u in vllm_urls[:2]]
        assert job["status"] == "completed" and job["result"]["replica_group"] == "canary"
        assert after[1] - before[1] >= 12 and after[0] == before[0]
