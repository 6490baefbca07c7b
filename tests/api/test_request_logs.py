"""Logs an operator can follow: with JSON logs and the access log on, one interactive request is
found by its id (the ``X-Request-Id`` the client got back) in the gateway's log and in the
replica's, and nothing is logged per request when the access log is off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.api.harness import DEV_KEY, fleet_dict, run_gateway, running
from tidal.replicas.launcher import ReplicaProcess, sim_process

JSON_LOGS = {"TIDAL_LOG_FORMAT": "json", "TIDAL_ACCESS_LOG": "true"}


def _lines(path: Path) -> list[dict[str, Any]]:
    """The log's JSON lines; any other line fails the test (JSON logs are JSON throughout)."""
    out = []
    for raw in path.read_text().splitlines():
        if raw.strip():
            out.append(json.loads(raw))
    return out


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    logs = tmp_path_factory.mktemp("sim-logs")
    with running(
        sim_process(
            "fast-test", args=["--served-model-name", "tiny"], log_path=logs / "sim.log", env=JSON_LOGS
        )
    ) as proc:
        yield proc


def test_a_request_is_followed_by_its_id_from_gateway_to_replica(sim: ReplicaProcess, tmp_path: Path) -> None:
    with run_gateway(tmp_path, fleet_dict([sim.url]), env=JSON_LOGS) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=False
        )
        answer = raw.parse()
        request_id = raw.headers["x-request-id"]
        assert request_id and answer.id.endswith(request_id)  # the engine ran it under that id
        gateway_log = gw.proc.log_path
    assert gateway_log is not None and sim.log_path is not None
    mine = [r for r in _lines(gateway_log) if r.get("request_id") == request_id]
    assert [(r["logger"], r["msg"]) for r in mine] == [("tidal.access", "request")], mine
    [line] = mine
    assert line["status"] == 200 and line["replica"] == "replica-0" and line["path"] == "/v1/chat/completions"
    assert line["level"] == "INFO" and line["ts"].endswith("+00:00") and line["duration_ms"] > 0
    assert line["completion_tokens"] == 4 and line["feature"] == "default"
    replica = [r for r in _lines(sim.log_path) if r.get("request_id") == request_id]
    assert [(r["logger"], r["status"], r["path"]) for r in replica] == [
        ("tidal.access", 200, "/v1/chat/completions")
    ]
    # The key is never in a log line
    assert DEV_KEY not in gateway_log.read_text()


def test_no_line_per_request_without_the_access_log(sim: ReplicaProcess, tmp_path: Path) -> None:
    with run_gateway(tmp_path, fleet_dict([sim.url]), env={"TIDAL_LOG_FORMAT": "json"}) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)
        for _ in range(3):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        log_path = gw.proc.log_path
    assert log_path is not None
    lines = _lines(log_path)
    assert lines and not [r for r in lines if r["logger"] == "tidal.access"]
