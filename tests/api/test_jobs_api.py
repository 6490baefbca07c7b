"""`POST /v1/jobs` refuses bad requests clearly and creates nothing; tenants see only their jobs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.fleet import parse_fleet
from tidal.settings import Settings


@pytest.fixture
def tc(tmp_path: Path) -> Iterator[TestClient]:
    fleet = parse_fleet(
        {
            "models": [
                {"name": "tiny", "max_model_len": 4096},
                {"name": "tiny-embed", "max_model_len": 512, "embedding": True},
            ],
            "pools": {
                "batch": {
                    "kind": "batch",
                    "model": "tiny",
                    "replicas": [{"name": "r", "url": "http://127.0.0.1:9"}],
                }
            },
        }
    )
    settings = Settings(_env_file=None, data_dir=tmp_path, broker_url="memory://")  # type: ignore[call-arg]
    keys = KeyStore()
    keys.add_key("key-a", Principal("tenant-a", frozenset({"*"})))
    keys.add_key("key-b", Principal("tenant-b", frozenset({"*"})))
    with TestClient(create_app(fleet, settings, keys=keys)) as client:
        yield client


def _upload(tc: TestClient, data: bytes, purpose: str = "user_data", key: str = "key-a") -> str:
    r = tc.post(
        "/v1/files",
        files={"file": ("ds.jsonl", data)},
        data={"purpose": purpose},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _post(tc: TestClient, body: dict[str, Any], key: str = "key-a") -> Any:
    return tc.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"})


DATASET = b'{"prompt": "2+2?", "reference": "4"}\n{"prompt": "3+3?", "reference": "6"}\n'


def test_a_job_starts_its_first_batch(tc: TestClient) -> None:
    fid = _upload(tc, DATASET)
    r = _post(
        tc,
        {
            "kind": "eval",
            "input_file_id": fid,
            "model": "tiny",
            "options": {"scorer": "exact", "priority": 8},
        },
    )
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "job" and job["status"] == "in_progress" and job["stage"] == 0
    assert job["current_batch"]["request_counts"]["total"] == 2
    got = tc.get(f"/v1/jobs/{job['id']}", headers={"Authorization": "Bearer key-a"}).json()
    assert got["id"] == job["id"]
    assert tc.get(f"/v1/jobs/{job['id']}", headers={"Authorization": "Bearer key-b"}).status_code == 404
    assert [
        j["id"] for j in tc.get("/v1/jobs", headers={"Authorization": "Bearer key-a"}).json()["data"]
    ] == [job["id"]]
    assert tc.get("/v1/jobs", headers={"Authorization": "Bearer key-b"}).json()["data"] == []
    cancelled = tc.post(f"/v1/jobs/{job['id']}/cancel", headers={"Authorization": "Bearer key-a"})
    assert cancelled.status_code == 200 and cancelled.json()["current_batch"]["status"] == "cancelling"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"kind": "translate"}, 400, "kind"),
        ({"model": "nope"}, 400, "not served"),
        ({"model": "tiny-embed"}, 400, "model_not_supported"),
        ({"kind": "embedding_backfill", "model": "tiny"}, 400, "need an embedding model"),
        ({"options": {"scorer": "judge", "judge_model": "tiny-embed"}}, 400, "judge_model"),
        ({"options": {"scorer": "judge"}}, 400, "judge_model"),
        ({"options": {"scorer": "judge", "judge_model": "nope"}}, 400, "judge_model"),
        ({"options": {"scorer": "regex", "pattern": "("}}, 400, "pattern"),
        ({"options": {"lane": "fast"}}, 400, "lane"),
        ({"options": {"pool": "batch"}}, 403, "admins"),
        ({"input_file_id": "file-nope"}, 404, "No such file"),
        ({"dataset": "bad"}, 400, "line 2: not valid JSON"),
        ({"purpose": "batch"}, 400, "purpose"),
    ],
)
def test_bad_job_requests_are_refused_and_create_nothing(
    tc: TestClient, body: dict[str, Any], status: int, needle: str
) -> None:
    data = b'{"prompt": "x"}\nnot json\n' if body.pop("dataset", None) else DATASET
    fid = _upload(tc, data, purpose=body.pop("purpose", "user_data"))
    full = {"kind": "eval", "input_file_id": fid, "model": "tiny", "options": {}}
    full.update(body)
    r = _post(tc, full)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in json.dumps(err).lower()
    assert tc.get("/v1/jobs", headers={"Authorization": "Bearer key-a"}).json()["data"] == []
    assert tc.get("/v1/batches", headers={"Authorization": "Bearer key-a"}).json()["data"] == []


def test_an_embedding_backfill_starts_on_an_embedding_model(tc: TestClient) -> None:
    fid = _upload(tc, b'{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n')
    r = _post(tc, {"kind": "embedding_backfill", "input_file_id": fid, "model": "tiny-embed", "options": {}})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "in_progress" and job["current_batch"]["request_counts"]["total"] == 1
    batch = tc.get(f"/v1/batches/{job['batch_ids'][0]}", headers={"Authorization": "Bearer key-a"}).json()
    assert batch["endpoint"] == "/v1/embeddings"
