"""The contract of `tidal up` for the batch tier: its gateway serves Files and Batches with the key
given by --api-key and runs a worker and the scheduler, so a batch submitted with the `openai` SDK
completes with no further set-up once the scheduler's batch gate has opened."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.batch_tier import RABBIT_URL, ROOT, chat_lines, read_jsonl, wait_for
from tidal.priority.queues import Topology, delete_topology
from tidal.replicas.launcher import free_port


@pytest.mark.vllm
def test_tidal_up_completes_a_batch_submitted_with_the_openai_sdk(
    tmp_path: Path, vllm_urls: list[str]
) -> None:
    # Given a fleet on running replicas (no `launch` blocks: tidal up starts no replicas)
    fleet = {
        "models": [{"name": "tiny", "max_model_len": 4096}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "shared": True,
                "model": "tiny",
                "replicas": [{"name": f"v{i}", "url": u} for i, u in enumerate(vllm_urls)],
            }
        },
    }
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    port, key, sched_port = free_port(), f"up-test-{secrets.token_hex(8)}", free_port()
    namespace = f"t{secrets.token_hex(5)}"
    # Its own queue names on the shared broker, whatever else runs `tidal up` here
    env = {**os.environ, "TIDAL_QUEUE_NAMESPACE": namespace}
    for var in ("TIDAL_DATABASE_URL", "TIDAL_FILES_DIR", "TIDAL_FLEET_CONFIG"):
        env.pop(var, None)
    log = (tmp_path / "up.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tidal", "up",
            "--config", str(tmp_path / "fleet.yaml"),
            "--port", str(port),
            "--api-key", key,
            "--data-dir", str(tmp_path / "data"),
            "--flower-port", str(free_port()),
            "--scheduler-port", str(sched_port),
            "--worker-metrics-port", str(free_port()),
            "--ready-timeout", "120",
        ],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out = tmp_path / "up.log"
        wait_for(lambda: "Ready." in out.read_text() or proc.poll() is not None, 180, "tidal up to be ready")
        assert proc.poll() is None, out.read_text()[-3000:]
        # And the scheduler runs, saying where its metrics are
        assert f"http://127.0.0.1:{sched_port}/metrics" in out.read_text()
        # And the summary says how to log in to Flower (the development login)
        assert "Flower: http://127.0.0.1:" in out.read_text() and "login: tidal / tidal" in out.read_text()
        sched_log = tmp_path / "data" / "logs" / "scheduler.log"
        assert "batch gate on interactive" in sched_log.read_text()
        # And its gate lends the shared pool to batch once the pool was calm for the hold time
        wait_for(
            lambda: (
                'tidal_gate_paused{pool="interactive"} 0.0'
                in httpx.get(f"http://127.0.0.1:{sched_port}/metrics", timeout=5).text
            ),
            30,
            "the batch gate to open",
        )
        assert "gate interactive -> open (calm)" in sched_log.read_text()
        # When a batch is submitted with the SDK and the key given to tidal up
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
        f = client.files.create(file=("in.jsonl", chat_lines(300)), purpose="batch")
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        final = wait_for(
            lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
            120,
            "the batch",
        )
        # Then it completes, every line answered once
        assert final.status == "completed", json.dumps(final.model_dump(), default=str)
        assert proc.poll() is None, out.read_text()[-3000:]
        lines = read_jsonl(client.files.content(final.output_file_id).text)
        assert sorted(x["custom_id"] for x in lines) == sorted(f"r{i}" for i in range(300))
        # And the store lives under the data dir
        assert (tmp_path / "data" / "tidal.db").exists()
        # And people get the same from the command line, with progress and the result files
        cli_env = {**os.environ, "TIDAL_BASE_URL": f"http://127.0.0.1:{port}/v1", "TIDAL_API_KEY": key}
        (tmp_path / "in.jsonl").write_bytes(chat_lines(40))
        run = subprocess.run(
            [sys.executable, "-m", "tidal", "batch", "submit", str(tmp_path / "in.jsonl"), "--priority", "9", "--watch",
             "--out", str(tmp_path / "results")],
            cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert "completed=40 failed=0 total=40" in run.stdout
        [written] = list((tmp_path / "results").glob("*_output.jsonl"))
        assert len(read_jsonl(written.read_text())) == 40
        (tmp_path / "qa.jsonl").write_text(
            "".join(json.dumps({"prompt": f"q{i}", "reference": ""}) + "\n" for i in range(5))
        )
        run = subprocess.run(
            [sys.executable, "-m", "tidal", "jobs", "submit", "eval", str(tmp_path / "qa.jsonl"), "--model", "tiny",
             "--scorer", "contains", "--watch"],
            cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert '"score": 1.0' in run.stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
        with contextlib.suppress(Exception):
            delete_topology(RABBIT_URL, Topology(namespace))
    # And Ctrl-C stopped the scheduler cleanly
    sched_log = tmp_path / "data" / "logs" / "scheduler.log"
    assert "scheduler stopped" in sched_log.read_text(), sched_log.read_text()[-3000:]


@pytest.mark.parametrize(
    ("url", "fallback"),
    [("amqp://guest:guest@127.0.0.1:1//", True), ("filesystem://", False)],
)
def test_tidal_up_falls_back_to_an_embedded_broker_and_says_what_it_loses(
    url: str, fallback: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tidal.cli.up import batch_broker_env
    from tidal.settings import get_settings

    monkeypatch.setenv("TIDAL_BROKER_URL", url)
    get_settings.cache_clear()
    try:
        env, note = batch_broker_env(tmp_path)
    finally:
        get_settings.cache_clear()
    if fallback:
        assert env == {"TIDAL_BROKER_URL": "filesystem://", "TIDAL_BROKER_DIR": str(tmp_path / "broker")}
        assert note is not None
        for loss in ("priorities", "remote control", "Flower"):
            assert loss in note
    else:
        assert env == {"TIDAL_BROKER_URL": url} and note is None
