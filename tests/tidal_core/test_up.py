"""`tidal up` on the embedded fleet: its scheduler autoscales the interactive pool with the local
actuator, and `tidal up` says so with the capacity it planned on the simulated replica."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from tidal.cli.platform import embedded_fleet
from tidal.cli.up import autoscaler_lines
from tidal.defaults import DEFAULT_FLEET_PATH
from tidal.fleet import load_fleet, parse_fleet
from tidal.replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_the_autoscaler_line_gives_each_pools_capacity_once_the_scheduler_exports_it() -> None:
    fleet = load_fleet(DEFAULT_FLEET_PATH)
    assert autoscaler_lines(fleet, "") == {}
    metrics = (
        "# TYPE tidal_autoscaler_planned_capacity_requests_per_second gauge\n"
        'tidal_autoscaler_planned_capacity_requests_per_second{pool="interactive"} 43.25\n'
    )
    assert autoscaler_lines(fleet, metrics) == {
        "interactive": "autoscaler: running on pool interactive (2-4 replicas, policy tidal); planned "
        "capacity 43.2 requests/s per replica, measured on the simulated replica (llama-3.1-8b-h100, "
        "virtual time) at TTFT p95 <= 1 s, TPOT p95 <= 50 ms"
    }
    hand = parse_fleet(
        {
            "models": [{"name": "m"}],
            "pools": {
                "p": {"kind": "interactive", "model": "m", "autoscale": {"capacity_rps_per_replica": 8}}
            },
        }
    )
    line = autoscaler_lines(hand, metrics.replace("interactive", "p").replace("43.25", "8.0"))["p"]
    assert line.endswith("capacity 8 requests/s per replica (capacity_rps_per_replica)")


@pytest.mark.slow
def test_tidal_up_runs_the_autoscaler_and_prints_its_planned_capacity(tmp_path: Path) -> None:
    # The embedded fleet, on free ports (the replicas' ports are fixed in it)
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(embedded_fleet(), sort_keys=False))
    env = {**os.environ, "TIDAL_QUEUE_NAMESPACE": f"t{secrets.token_hex(5)}"}
    for var in ("TIDAL_DATABASE_URL", "TIDAL_FILES_DIR", "TIDAL_FLEET_CONFIG", "TIDAL_DATA_DIR"):
        env.pop(var, None)
    out = tmp_path / "up.log"

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable, "-m", "tidal", "up", "--config", str(tmp_path / "fleet.yaml"),
                "--port", str(free_port()), "--data-dir", str(tmp_path / "data"),
                "--flower-port", str(free_port()), "--scheduler-port", str(free_port()),
                "--worker-metrics-port", str(free_port()),
            ],
            cwd=ROOT, env=env, stdout=out.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait_for_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"^autoscaler: running on pool interactive.*$", out.read_text(), re.M)
            if found:
                return found.group(0)
            time.sleep(0.5)
        raise AssertionError(f"no autoscaler line from tidal up:\n{out.read_text()[-3000:]}")

    def wait_for_outcome(path: Path, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                outcome: dict[str, str] = json.loads(path.read_text())["pools"]["interactive"]
                return outcome
            time.sleep(0.5)
        raise AssertionError(
            f"no canary outcome:\n{(tmp_path / 'data' / 'logs' / 'scheduler.log').read_text()[-3000:]}"
        )

    def stop(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    proc = start()
    try:
        # When it starts for the first time, it is ready while the scheduler plans the capacity
        line = wait_for_line(proc, 240)
        log = out.read_text()
        assert log.index("Ready.") < log.index("autoscaler: planning the capacity of interactive")
        # Then it prints the capacity measured on the fleet's simulated replica
        found = re.search(r"planned capacity ([\d.]+) requests/s per replica", line)
        assert found is not None
        rps = float(found.group(1))
        assert 10.0 < rps < 200.0 and "llama-3.1-8b-h100" in line
        sched = (tmp_path / "data" / "logs" / "scheduler.log").read_text()
        assert "interactive (local actuator): 2-4 replicas" in sched
        # Every part of the platform is up, and the summary says where
        for part in ("sim-c0", "sim-l0", "sim-s0", "external", "gateway", "worker", "scheduler"):
            assert re.search(rf"^  {part} ", log, re.M), part
        # The canary build answers the eval set worse than the stable one: rolled back on its score
        outcome = wait_for_outcome(tmp_path / "data" / "scheduler" / "canary-outcomes.json", 120)
        assert outcome["outcome"] == "rolled_back" and outcome["reason"].startswith("eval_score"), outcome
        # A LoRA adapter is loaded on first use; a regulated feature is served like any other
        api = re.search(r"OpenAI base URL: (\S+) +API key: (\S+)", log)
        assert api is not None
        client = openai.OpenAI(base_url=api.group(1), api_key=api.group(2))
        for model, feature in (("support-bot", "chat"), ("llama-3.1-8b-instruct", "regulated-chat")):
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=4,
                extra_headers={"X-Tidal-Feature": feature},
            )
            assert reply.model == model and reply.choices[0].message.content
    finally:
        stop(proc)
    # And the next start has it at once, from the cache under the data dir
    proc = start()
    try:
        assert f"planned capacity {rps:.1f} requests/s" in wait_for_line(proc, 120)
        assert "autoscaler: planning" not in out.read_text()
    finally:
        stop(proc)
    assert "scheduler stopped" in (tmp_path / "data" / "logs" / "scheduler.log").read_text()
