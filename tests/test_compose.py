"""docker-compose.yml describes the production shape and parses."""

from __future__ import annotations

from pathlib import Path

import yaml

from tidal.fleet import load_fleet

ROOT = Path(__file__).resolve().parents[1]


def test_compose_file_parses_and_has_the_production_shape() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in [
        "rabbitmq",
        "postgres",
        "gateway",
        "scheduler",
        "worker-reserved",
        "worker-spot",
        "worker-shared",
        "flower",
        "prometheus",
        "grafana",
    ]:
        assert name in services, name
    assert "management" in services["rabbitmq"]["image"]
    gpu = [n for n, s in services.items() if "gpu" in s.get("profiles", [])]
    sim = [n for n, s in services.items() if "sim" in s.get("profiles", [])]
    assert gpu and sim
    # Anchors resolve: every tidal service gets the shared environment.
    assert services["worker-spot"]["environment"]["TIDAL_ENVIRONMENT"] == "production"
    for name in ["gateway", "scheduler", "worker-reserved", "flower"]:
        assert services[name]["command"][0] in {"gateway", "scheduler", "worker", "flower"}
    # The scheduler reaches the gateway's admin API and Prometheus reaches its metrics.
    sched = services["scheduler"]["command"]
    assert sched[sched.index("--gateway") + 1] == "http://gateway:8000"
    assert sched[sched.index("--metrics-host") + 1] == "0.0.0.0"


def test_compose_fleet_and_prometheus_config_are_valid() -> None:
    fleet = load_fleet(ROOT / "deploy" / "fleet.compose.yaml")
    assert fleet.pools["interactive"].shared
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} >= {"tidal-gateway", "replicas"}


def test_kubernetes_manifests_parse() -> None:
    docs = [
        d
        for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name in [
        "tidal-gateway",
        "tidal-scheduler",
        "tidal-worker-reserved",
        "tidal-worker-spot",
        "tidal-worker-shared",
        "tidal-flower",
        "vllm-interactive",
    ]:
        assert ("Deployment", name) in kinds, name
    fleet_cm = next(d for d in docs if d["kind"] == "ConfigMap")
    from tidal.fleet import parse_fleet

    parse_fleet(yaml.safe_load(fleet_cm["data"]["fleet.yaml"]), "k8s configmap")
