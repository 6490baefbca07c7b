"""The Grafana dashboard against a real Prometheus: `tidal up` on the embedded fleet (its gate
made quick to pause, its autoscaler sized to grow under a little traffic, and one registered
replica that is not there), scraped by Debian's `prometheus` with `deploy/prometheus.yml` pointed
at the test's ports and loading the shipped alert rules; under chat, embeddings and a batch,
every panel's query returns data."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.batch_tier import chat_lines, require_rabbitmq, wait_for
from tests.services import require_tool
from tidal.cli.platform import LocalPlatform, embedded_fleet, local_platform
from tidal.replicas.launcher import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tidal.json"


def _fleet(tmp: Path) -> dict[str, int]:
    """The embedded fleet on free ports, written to ``tmp``; returns the replicas' ports."""
    data = embedded_fleet()
    # Two requests at a time per interactive replica: the traffic below queues, the gate pauses
    # batch, the rest overflows to the external provider; calm again, the gate reopens
    data["pools"]["interactive"].update(max_inflight_per_replica=2, min_inflight_per_replica=2)
    data["gate"]["hold_s"] = 1
    # One request per second per replica of capacity, decided every 2 s: the pool grows
    data["pools"]["interactive"]["autoscale"] = {
        "min_replicas": 2,
        "max_replicas": 3,
        "cold_start_s": 5,
        "capacity_rps_per_replica": 1.0,
        "decision_interval_s": 2.0,
    }
    (tmp / "fleet.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    ports = {
        r["name"]: int(r["url"].rsplit(":", 1)[1]) for p in data["pools"].values() for r in p["replicas"]
    }
    ports["external"] = int(data["external_provider"]["url"].split(":")[2].split("/")[0])
    return ports


def _prometheus_config(tmp: Path, targets: dict[str, list[str]]) -> Path:
    """deploy/prometheus.yml with the test's targets, scraping every second."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(ROOT / "deploy" / "prometheus" / "alerts.yml")]
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (p["title"], t["expr"].replace("$pool", ".*"))
        for p in dashboard["panels"]
        for t in p.get("targets", [])
        if "expr" in t
    ]


def _traffic(base: str, key: str, seconds: float) -> dict[str, int]:
    """Chat streams (16 at a time, long enough prompts to fill some KV), embeddings and a batch."""
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
    until = time.monotonic() + seconds
    prompt = " ".join(f"word{i}" for i in range(600))

    def chat(i: int) -> int:
        n = 0
        while time.monotonic() < until:
            try:
                stream = client.chat.completions.create(
                    model="llama-3.1-8b-instruct",
                    messages=[{"role": "user", "content": f"{i} {n} {prompt}"}],
                    max_tokens=64,
                    stream=True,
                )
                for _ in stream:
                    pass
                n += 1
            except openai.RateLimitError:
                time.sleep(0.2)  # refused at admission (a 429): what a client does
        return n

    f = client.files.create(file=("in.jsonl", chat_lines(40, model="llama-3.1-8b-instruct")), purpose="batch")
    client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        chats = [pool.submit(chat, i) for i in range(16)]
        embedded = 0
        while time.monotonic() < until:
            client.embeddings.create(model="e5-mistral-7b-instruct", input=["a sentence to embed"])
            embedded += 1
            time.sleep(0.2)
        return {"chat": sum(c.result() for c in chats), "embeddings": embedded}


def _query(prom: str, expr: str) -> list[dict[str, Any]]:
    got = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert got["status"] == "success", (expr, got)
    result: list[dict[str, Any]] = got["data"]["result"]
    return result


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[tuple[LocalPlatform, dict[str, int]]]:
    require_rabbitmq()
    ports = _fleet(tmp_path)
    with local_platform(tmp_path / "fleet.yaml", tmp_path / "run", log=lambda _: None) as p:
        yield p, ports


def test_every_dashboard_panel_has_data_in_a_real_prometheus(
    platform: tuple[LocalPlatform, dict[str, int]], tmp_path: Path
) -> None:
    binary = require_tool("prometheus", "Debian's prometheus package")
    p, ports = platform

    def target(url: str) -> list[str]:
        return [url.removeprefix("http://")]

    targets = {
        "tidal-gateway": target(p.url),
        "tidal-scheduler": target(p.scheduler_url),
        "tidal-worker": target(p.worker_metrics_url),
        "flower": target(p.flower_url),
        "replicas": [f"127.0.0.1:{port}" for port in ports.values()],
    }
    prom_port = free_port()
    prom = f"http://127.0.0.1:{prom_port}"
    config = _prometheus_config(tmp_path, targets)
    with (tmp_path / "prometheus.log").open("wb") as log:
        server = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: _ready(prom), 60, "prometheus to be ready")
        # A replica that is registered but not there: probes fail, requests sent to it are retried
        gw = p.url
        admin = {"Authorization": f"Bearer {p.admin_key}"}
        ghost = {"name": "ghost-0", "url": f"http://127.0.0.1:{free_port()}", "pool": "interactive"}
        assert httpx.post(f"{gw}/admin/replicas", json=ghost, headers=admin, timeout=10).status_code == 201
        done = _traffic(f"{gw}/v1", p.key, 25.0)
        assert done["chat"] > 20 and done["embeddings"] > 20, done

        queries = _panel_queries()
        panels = {title for title, _ in queries}
        assert len(panels) >= 20
        empty: list[str] = []

        def all_have_data() -> bool:
            # A panel shows data when one of its queries returns a series
            shown = {title for title, expr in queries if _query(prom, expr)}
            empty[:] = [f"{t}: {[e for title, e in queries if title == t]}" for t in sorted(panels - shown)]
            return not empty

        try:
            wait_for(all_have_data, 60, "every panel's query to return data")
        except Exception:
            raise AssertionError("panels without data:\n" + "\n".join(empty)) from None
        # And the shipped alert rules are loaded and evaluated
        rules = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
        assert rules and all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    finally:
        server.terminate()
        server.wait(30)


def _ready(prom: str) -> bool:
    try:
        return httpx.get(f"{prom}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
