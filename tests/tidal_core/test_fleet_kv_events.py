"""The fleet's KV-event endpoints load strictly, and launch blocks publish where the fleet says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tidal.cli.up import kv_events_args, plan_parts
from tidal.defaults import DEFAULT_FLEET_PATH
from tidal.fleet import FleetConfigError, KubernetesKVEventsSpec, KVEventsSpec, load_fleet, parse_fleet


def fleet(*replicas: dict[str, Any], tokenizer: str | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"name": "m"}
    if tokenizer is not None:
        model["tokenizer"] = tokenizer
    return {
        "models": [model],
        "pools": {"interactive": {"kind": "interactive", "model": "m", "replicas": list(replicas)}},
    }


def replica(name: str, port: int, kv: Any = None) -> dict[str, Any]:
    r: dict[str, Any] = {"name": name, "url": f"http://127.0.0.1:{port}"}
    if kv is not None:
        r["kv_events"] = kv
    return r


def test_endpoints_and_tokenizer_load() -> None:
    f = parse_fleet(
        fleet(
            replica("a", 9001, {"endpoint": "tcp://10.0.0.5:5557", "replay_endpoint": "tcp://10.0.0.5:5558"}),
            replica("b", 9002, {"endpoint": "ipc:///run/b.sock", "topic": "kv"}),
            replica("c", 9003),
            tokenizer="sim",
        )
    )
    a, b, c = (r for _, r in f.all_replicas())
    assert a.kv_events == KVEventsSpec(endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558")
    assert b.kv_events is not None and b.kv_events.replay_endpoint is None and b.kv_events.topic == "kv"
    assert c.kv_events is None and f.model("m").tokenizer == "sim"


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        ({"endpoint": "tcp://*:5557"}, "a wildcard host is for binding"),
        ({"endpoint": "http://x:1"}, "is not tcp://HOST:PORT"),
        ({"endpoint": "tcp://h:70000"}, "port out of range"),
        ({"endpoint": "tcp://h:1", "replay_endpoint": "tcp://h:1"}, "must differ"),
        ({"endpoint": "tcp://h:1", "bogus": 1}, "kv_events.bogus: unknown key"),
        ({"replay_endpoint": "tcp://h:1"}, "endpoint"),
    ],
)
def test_bad_endpoints_are_refused_naming_the_key(kv: dict[str, Any], expected: str) -> None:
    with pytest.raises(FleetConfigError) as err:
        parse_fleet(fleet(replica("a", 9001, kv)))
    assert "kv_events" in str(err.value) and expected in str(err.value)


def test_two_replicas_cannot_share_an_endpoint() -> None:
    same = {"endpoint": "tcp://h:5557"}
    with pytest.raises(FleetConfigError, match="kv_events endpoints: duplicate name 'tcp://h:5557'"):
        parse_fleet(fleet(replica("a", 9001, same), replica("b", 9002, same)))


def autoscaled(kv: Any) -> dict[str, Any]:
    f = fleet()
    target = {"deployment": "vllm-interactive", "namespace": "tidal", "port": 8000, "kv_events": kv}
    f["pools"]["interactive"]["autoscale"] = {"kubernetes": target}
    return f


def test_a_kubernetes_target_names_the_ports_its_pods_publish_on() -> None:
    f = parse_fleet(autoscaled({"port": 5557, "replay_port": 5558}))
    spec = f.pools["interactive"].autoscale
    assert spec is not None and spec.kubernetes is not None
    assert spec.kubernetes.kv_events == KubernetesKVEventsSpec(port=5557, replay_port=5558, topic="")
    plain = parse_fleet(autoscaled({"port": 5557, "topic": "kv"})).pools["interactive"].autoscale
    assert plain is not None and plain.kubernetes is not None and plain.kubernetes.kv_events is not None
    assert plain.kubernetes.kv_events.replay_port is None and plain.kubernetes.kv_events.topic == "kv"


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        ({"port": 5557, "replay_port": 5557}, "kubernetes.kv_events: replay_port must differ from port"),
        ({"port": 8000}, "kubernetes: kv_events ports must differ from the HTTP port"),
        ({"port": 5557, "replay_port": 8000}, "kv_events ports must differ from the HTTP port"),
        ({"port": 70000}, "kubernetes.kv_events.port"),
        ({"port": 0}, "kubernetes.kv_events.port"),
        ({"port": 5557, "replay": 5558}, "kubernetes.kv_events.replay: unknown key"),
        ({"endpoint": "tcp://h:5557"}, "kubernetes.kv_events.endpoint: unknown key"),
        ({"replay_port": 5558}, "kubernetes.kv_events.port"),
    ],
)
def test_bad_kubernetes_event_ports_are_refused_naming_the_key(kv: dict[str, Any], expected: str) -> None:
    with pytest.raises(FleetConfigError) as err:
        parse_fleet(autoscaled(kv))
    assert "pools.interactive.autoscale.kubernetes" in str(err.value) and expected in str(err.value)


def test_launch_blocks_bind_the_fleets_ports(tmp_path: Path) -> None:
    spec = KVEventsSpec(endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558", topic="kv")
    assert kv_events_args("sim", spec) == [
        "--kv-events-endpoint",
        "tcp://*:5557",
        "--kv-events-topic",
        "kv",
        "--kv-events-replay-endpoint",
        "tcp://*:5558",
    ]
    vllm = kv_events_args("vllm", spec)
    assert vllm[:2] == ["--no-kv-events", "--kv-events-config"]
    assert '"endpoint": "tcp://*:5557"' in vllm[2] and '"enable_kv_cache_events": true' in vllm[2]
    assert kv_events_args("vllm", None) == ["--no-kv-events"] and kv_events_args("sim", None) == []
    # The embedded fleet's interactive simulators publish, and tidal up starts them so.
    parts = {p.name: p for p in plan_parts(DEFAULT_FLEET_PATH, port=8123, api_key="k", data_dir=tmp_path)}
    assert "--kv-events-endpoint" in parts["sim-i0"].args and "tcp://*:8201" in parts["sim-i0"].args
    assert "--kv-events-endpoint" not in parts["sim-b0"].args
    assert load_fleet(DEFAULT_FLEET_PATH).model("llama-3.1-8b-instruct").tokenizer == "sim"
