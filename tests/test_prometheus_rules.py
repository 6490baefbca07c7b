"""The alerting rules that ship in deploy/prometheus: promtool accepts them and the Prometheus
config that loads them, each alert fires on the series that should fire it (promtool's unit
tests, deploy/prometheus/alerts_test.yml), and every series they and the dashboard read is one
the platform exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.services import require_tool

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
SOURCES = ["api", "router", "scheduler", "workers", "priority", "batch_jobs", "replicas"]


def _promtool(*args: str, cwd: Path) -> str:
    tool = require_tool("promtool", "Debian's prometheus package")
    done = subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("check", "rules", "prometheus/alerts.yml"),
        ("check", "config", "prometheus.yml"),
        ("test", "rules", "prometheus/alerts_test.yml"),
    ],
    ids=["check rules", "check config", "unit tests"],
)
def test_promtool_accepts_the_rules_and_their_tests_pass(args: tuple[str, ...]) -> None:
    out = _promtool(*args, cwd=ROOT / "deploy")
    assert "SUCCESS" in out


def test_every_alert_has_a_unit_test() -> None:
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    tested = {
        t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if t.get("exp_alerts")
    }
    assert alerts == tested, f"alerts without a firing test: {sorted(alerts - tested)}"


def _exported() -> set[str]:
    names: set[str] = set()
    for pkg in SOURCES:
        for path in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r'"(tidal_[a-z0-9_]+)"', path.read_text()))
    return names


def _base(series: str) -> str:
    return re.sub(r"_(bucket|count|sum|total)$", "", series)


def test_the_alerts_and_the_dashboard_read_series_the_platform_exports() -> None:
    exported = {_base(n) for n in _exported()}
    texts = [(PROM / "alerts.yml").read_text()]
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "tidal.json").read_text())
    texts += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t]
    read = {_base(name) for text in texts for name in re.findall(r"\btidal_[a-z0-9_]+", text)}
    unknown = sorted(read - exported)
    assert not unknown, f"series no part of the platform exports: {unknown}"
