"""The deployment files that read the scheduler's metrics: the KEDA ScaledObject and the Grafana
dashboard must name series the scheduler really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tidal.scheduler.metrics import SchedulerMetrics

ROOT = Path(__file__).resolve().parents[2]
OURS = re.compile(r"\btidal_(?:gate|autoscaler|health|canary)_[a-z0-9_]+")


def exported_series() -> set[str]:
    names: set[str] = set()
    for family in SchedulerMetrics().registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def test_keda_scales_the_interactive_deployment_to_the_desired_gauge() -> None:
    (obj,) = list(yaml.safe_load_all((ROOT / "deploy" / "keda" / "scaledobject.yaml").read_text()))
    assert obj["kind"] == "ScaledObject" and obj["apiVersion"].startswith("keda.sh/")
    deployments = {
        d["metadata"]["name"]
        for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "vllm.yaml").read_text())
        if d and d["kind"] == "Deployment"
    }
    assert obj["spec"]["scaleTargetRef"]["name"] in deployments
    (trigger,) = obj["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    assert set(OURS.findall(trigger["metadata"]["query"])) == {"tidal_autoscaler_desired_replicas"}
    assert "tidal_autoscaler_desired_replicas" in exported_series()


def test_the_dashboard_covers_every_part_and_names_only_series_the_scheduler_exports() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "tidal.json").read_text())
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in panels if p["type"] == "row"]
    for part in ("Gateway", "Batch gate", "Autoscaler", "Replicas"):
        assert any(part in r for r in rows), part
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    referenced = {m for e in exprs for m in OURS.findall(e)}
    assert referenced and referenced <= exported_series(), referenced - exported_series()
    assert any("vllm:kv_cache_usage_perc" in e for e in exprs)
    assert any("tidal_gateway_ttft_seconds" in e for e in exprs)
