"""Isolation in the batch tier through the official SDK: lines and jobs naming an adapter bound to
another tenant are refused as unknown models, and a batch of a feature with ``regions`` is kept
to pools in them (refused at submission when none there can serve it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from tests.batch_tier import chat_lines, openai_client
from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.fleet import parse_fleet
from tidal.settings import Settings

ALL = frozenset({"*"})


def _pool(kind: str, region: str, **kw: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "model": "tiny",
        "region": region,
        "replicas": [{"name": f"{kind}-{region}", "url": "http://127.0.0.1:9"}],
        **kw,
    }


FLEET = {
    "models": [{"name": "tiny"}],
    "adapters": [{"name": "acme-lora", "path": "/adapters/acme", "base_model": "tiny", "tenants": ["acme"]}],
    "pools": {
        # reserved lane: us-east only; spot and shared lanes: eu-west; ap-south serves no batch
        "us-batch": _pool("batch", "us-east"),
        "eu-spot": _pool("spot", "eu-west"),
        "eu-chat": _pool("interactive", "eu-west", shared=True),
        "ap-chat": _pool("interactive", "ap-south"),
    },
    "features": {
        "default": {},
        "gdpr": {"regions": ["eu-west"]},
        "usdata": {"regions": ["us-east"]},
        "apac": {"regions": ["ap-south"]},
    },
    "tenants": [{"name": "acme"}, {"name": "globex"}],
}


@pytest.fixture
def tc(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(_env_file=None, data_dir=tmp_path, broker_url="memory://")  # type: ignore[call-arg]
    keys = KeyStore()
    keys.add_key("key-acme", Principal("acme", ALL))
    keys.add_key("key-globex", Principal("globex", ALL))
    keys.add_key("key-default", Principal("acme", frozenset({"default"})))
    keys.add_key("key-resident", Principal("acme", frozenset({"gdpr", "usdata"})))
    keys.add_key("key-admin", Principal("ops", ALL, admin=True))
    with TestClient(create_app(parse_fleet(FLEET), settings, keys=keys)) as client:
        yield client


def _create(client: openai.OpenAI, data: bytes, **metadata: str) -> Any:
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata or None,
    )


def _stored(tc: TestClient, batch_id: str) -> tuple[str, str | None, list[str] | None]:
    """(queue lane, feature, regions) as the store keeps them for the workers."""
    settings: Settings = tc.app.state.tidal.settings  # type: ignore[attr-defined]
    engine = create_engine(settings.resolved_database_url)
    try:
        with engine.connect() as c:
            lane, feature, regions = c.execute(
                text("SELECT queue_lane, feature, regions_json FROM tidal_batches WHERE id = :b"),
                {"b": batch_id},
            ).one()
    finally:
        engine.dispose()
    return lane, feature, json.loads(regions) if regions else None


# -- adapters bound to tenants ----------------------------------------------------------------------


def test_a_batch_line_naming_another_tenants_adapter_is_an_unknown_model(tc: TestClient) -> None:
    globex, acme = openai_client(tc, "key-globex"), openai_client(tc, "key-acme")
    bound = _create(globex, chat_lines(1, model="acme-lora"))
    unknown = _create(globex, chat_lines(1, model="acme-lorb"))
    assert bound.status == unknown.status == "failed"
    assert [(e.line, e.code) for e in bound.errors.data] == [(1, "model_not_found")]
    assert bound.errors.data[0].message == unknown.errors.data[0].message.replace("acme-lorb", "acme-lora")
    assert "acme-lora" not in bound.errors.data[0].message.split("served:")[1]
    # The tenant it is bound to may use it
    assert _create(acme, chat_lines(1, model="acme-lora")).status == "in_progress"


def test_a_job_naming_another_tenants_adapter_is_an_unknown_model(tc: TestClient) -> None:
    def job(key: str, model: str) -> Any:
        auth = {"Authorization": f"Bearer {key}"}
        fid = tc.post(
            "/v1/files",
            files={"file": ("ds.jsonl", b'{"prompt": "2+2?", "reference": "4"}\n')},
            data={"purpose": "evals"},
            headers=auth,
        ).json()["id"]
        return tc.post("/v1/jobs", json={"kind": "eval", "input_file_id": fid, "model": model}, headers=auth)

    bound, unknown = job("key-globex", "acme-lora"), job("key-globex", "acme-lorb")
    assert bound.status_code == unknown.status_code == 400
    assert json.dumps(bound.json()) == json.dumps(unknown.json()).replace("acme-lorb", "acme-lora")
    assert bound.json()["error"]["code"] == "model_not_found"
    assert job("key-acme", "acme-lora").status_code == 200


# -- data residency -----------------------------------------------------------------------------

PLACED = [
    # (case, metadata, queue lane, feature, regions)
    ("no regions: lane any stays on the shared queue", {}, "shared", "default", None),
    (
        "eu-west: the spot lane, the first whose pools are there",
        {"feature": "gdpr"},
        "spot",
        "gdpr",
        ["eu-west"],
    ),
    ("us-east: the reserved lane", {"feature": "usdata"}, "reserved", "usdata", ["us-east"]),
    (
        "eu-west on the spot lane it asked for",
        {"feature": "gdpr", "lane": "spot"},
        "spot",
        "gdpr",
        ["eu-west"],
    ),
]


@pytest.mark.parametrize(
    ("case", "metadata", "lane", "feature", "regions"), PLACED, ids=[c[0] for c in PLACED]
)
def test_a_batch_is_kept_to_its_features_regions(
    tc: TestClient, case: str, metadata: dict[str, str], lane: str, feature: str, regions: list[str] | None
) -> None:
    batch = _create(openai_client(tc, "key-acme"), chat_lines(3), **metadata)
    assert batch.status == "in_progress"
    assert _stored(tc, batch.id) == (lane, feature, regions)


REFUSED = [
    # (case, key, metadata, error class, code, param)
    (
        "no pool in the regions serves batches",
        "key-acme",
        {"feature": "apac"},
        openai.BadRequestError,
        "no_pool_in_region",
        "metadata.feature",
    ),
    (
        "the lane asked for has no pool there",
        "key-acme",
        {"feature": "gdpr", "lane": "reserved"},
        openai.BadRequestError,
        "no_pool_in_region",
        "metadata.feature",
    ),
    (
        "a pinned pool outside the regions",
        "key-admin",
        {"feature": "gdpr", "pool": "us-batch"},
        openai.BadRequestError,
        "region_not_allowed",
        "metadata.pool",
    ),
    (
        "an unknown feature",
        "key-acme",
        {"feature": "nope"},
        openai.BadRequestError,
        "unknown_feature",
        "metadata.feature",
    ),
    (
        "a feature the key may not use",
        "key-default",
        {"feature": "gdpr"},
        openai.PermissionDeniedError,
        "feature_not_allowed",
        "metadata.feature",
    ),
    (
        "a key of resident features names none",
        "key-resident",
        {},
        openai.BadRequestError,
        "feature_required",
        "metadata.feature",
    ),
]


@pytest.mark.parametrize(
    ("case", "key", "metadata", "error", "code", "param"), REFUSED, ids=[c[0] for c in REFUSED]
)
def test_a_batch_that_cannot_stay_in_its_regions_is_refused_at_submission(
    tc: TestClient,
    case: str,
    key: str,
    metadata: dict[str, str],
    error: type[openai.APIStatusError],
    code: str,
    param: str,
) -> None:
    client = openai_client(tc, key)
    with pytest.raises(error) as err:
        _create(client, chat_lines(3), **metadata)
    assert err.value.code == code and err.value.param == param, err.value.response.text  # type: ignore[attr-defined]
    assert client.batches.list().data == []


def test_a_jobs_batches_run_under_its_feature(tc: TestClient) -> None:
    auth = {"Authorization": "Bearer key-acme"}
    fid = tc.post(
        "/v1/files",
        files={"file": ("ds.jsonl", b'{"prompt": "2+2?", "reference": "4"}\n')},
        data={"purpose": "evals"},
        headers=auth,
    ).json()["id"]
    body = {"kind": "eval", "input_file_id": fid, "model": "tiny", "options": {"feature": "gdpr"}}
    r = tc.post("/v1/jobs", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert _stored(tc, r.json()["current_batch"]["id"]) == ("spot", "gdpr", ["eu-west"])
    body["options"] = {"feature": "apac"}
    refused = tc.post("/v1/jobs", json=body, headers=auth)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_pool_in_region"
