"""`tidal scheduler`: clear failures at start, and a real process that serves its metrics, acts on
the gateway's admin API and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from click.testing import CliRunner

from tests.scheduler.test_signals import FakeGateway
from tidal.cli import cli
from tidal.replicas.launcher import free_port
from tidal.settings import get_settings

ROOT = Path(__file__).resolve().parents[2]


def fleet_data() -> dict[str, Any]:
    return {
        "models": [{"name": "m"}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": "m",
                "shared": True,
                "replicas": [{"name": "i0", "url": "http://127.0.0.1:9001"}],
            }
        },
    }


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    for var in ("TIDAL_ADMIN_KEY", "TIDAL_FLEET_CONFIG", "TIDAL_ENVIRONMENT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


def write(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_help_lists_the_options() -> None:
    result = CliRunner().invoke(cli, ["scheduler", "--help"])
    assert result.exit_code == 0, result.output
    for option in (
        "--gateway",
        "--metrics-port",
        "--no-gate",
        "--no-health",
        "--no-autoscale",
        "--probe-period",
    ):
        assert option in result.output


def test_a_bad_config_fails_naming_the_key(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("TIDAL_ADMIN_KEY", "admin-key-for-tests-0123456789")
    data = fleet_data()
    data["pools"]["interactive"]["canary"] = {"stepz": [0.1]}
    result = CliRunner().invoke(cli, ["scheduler", "--config", write(tmp_path, data)])
    assert result.exit_code == 1
    assert "is invalid" in result.output and "pools.interactive.canary.stepz: unknown key" in result.output


def test_without_the_admin_key_it_refuses_to_start(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["scheduler", "--config", write(tmp_path, fleet_data())])
    assert result.exit_code == 2
    assert "TIDAL_ADMIN_KEY is not set" in result.output


def test_a_bad_autoscaler_policy_or_gateway_url_fails_with_the_reason(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env.setenv("TIDAL_ADMIN_KEY", "admin-key-for-tests-0123456789")
    data = fleet_data()
    data["pools"]["interactive"]["autoscale"] = {"policy": "magic"}
    result = CliRunner().invoke(cli, ["scheduler", "--config", write(tmp_path, data), "--no-gate"])
    assert result.exit_code == 2
    assert "pools.interactive.autoscale: unknown autoscaler policy 'magic'" in result.output
    result = CliRunner().invoke(
        cli, ["scheduler", "--config", write(tmp_path, fleet_data()), "--no-gate", "--gateway", "file:///etc"]
    )
    assert result.exit_code == 2 and "file:///etc" in result.output


@pytest.mark.anyio
async def test_the_process_probes_replicas_serves_metrics_and_stops_on_sigterm(tmp_path: Path) -> None:
    # Given a gateway whose only replica does not answer
    gw = FakeGateway("admin-key-for-tests-0123456789", {"time": 1, "pools": {"interactive": {}}})
    dead = f"http://127.0.0.1:{free_port()}"
    gw.replicas["i0"] = {"name": "i0", "url": dead, "pool": "interactive", "healthy": True}
    await gw.server.start_server()
    port = free_port()
    log = (tmp_path / "scheduler.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tidal", "scheduler",
        "--config", write(tmp_path, fleet_data()),
        "--gateway", gw.url, "--no-gate", "--metrics-port", str(port),
        "--probe-period", "0.5", "--probe-timeout", "0.4",
        cwd=ROOT, stdout=log, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": "/usr/bin:/bin", "TIDAL_ADMIN_KEY": "admin-key-for-tests-0123456789",
             "TIDAL_DATA_DIR": str(tmp_path / "data")},
    )  # fmt: skip
    try:
        # When the scheduler runs, it takes the replica out of routing
        deadline = time.monotonic() + 30
        while ("PATCH", "i0", {"healthy": False}) not in gw.calls:
            assert proc.returncode is None and time.monotonic() < deadline, (
                tmp_path / "scheduler.log"
            ).read_text()
            await asyncio.sleep(0.1)
        # And counts it on its metrics port
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        assert 'tidal_health_transitions_total{replica="i0",to="unhealthy"} 1.0' in text
    finally:
        # Then SIGTERM stops it cleanly
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 20)
        await gw.server.close()
        log.close()
    out = (tmp_path / "scheduler.log").read_text()
    assert code == 0, out
    assert "health: a probe per replica every 0.5 s" in out and "scheduler stopped" in out
