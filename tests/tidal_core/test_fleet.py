"""The fleet config loads strictly: every bad key is named in the error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tidal.defaults import DEFAULT_FLEET_PATH
from tidal.fleet import FleetConfigError, GatewaySpec, hash_api_key, load_fleet, parse_fleet, verify_api_key


def minimal(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "models": [{"name": "m"}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": "m",
                "replicas": [{"name": "r0", "url": "http://127.0.0.1:9001"}],
            }
        },
    }
    data.update(overrides)
    return data


def test_default_fleet_loads() -> None:
    fleet = load_fleet(DEFAULT_FLEET_PATH)
    assert fleet.pools["interactive"].shared
    assert fleet.pools["interactive"].name == "interactive"
    assert [r.name for _, r in fleet.all_replicas()] == [
        "sim-i0", "sim-i1", "sim-c0", "sim-l0", "sim-e0", "sim-b0", "sim-s0"
    ]  # fmt: skip
    assert fleet.features["chat"].class_ == "interactive"


def test_the_default_fleet_shows_every_kind_of_pool_and_feature() -> None:
    fleet = load_fleet(DEFAULT_FLEET_PATH)
    assert {p.kind for p in fleet.pools.values()} == {"interactive", "long_context", "batch", "spot"}
    assert fleet.pools["interactive"].canary_group == "canary"
    [canary] = [r for r in fleet.pools["interactive"].replicas if r.group == "canary"]
    assert canary.weight == 0 and canary.launch is not None and canary.launch.accuracy == 0.3
    assert fleet.adapters[0].name in fleet.served_models("anyone", "/v1/chat/completions")
    assert fleet.external_provider is not None and fleet.external_provider.launch is not None
    assert fleet.features["regulated-chat"].regulated


def test_files_a_fleet_names_by_relative_path_are_read_from_its_folder(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "eval.jsonl").write_text('{"prompt": "p", "reference": "r", "answer": "r"}\n')
    replica = {
        "name": "r0",
        "url": "http://127.0.0.1:9001",
        "launch": {"kind": "sim", "preset": "fast-test", "answer_key": "eval.jsonl", "accuracy": 0.5},
    }
    data = minimal()
    data["pools"]["interactive"]["replicas"] = [replica, {**replica, "name": "r1", "group": "canary"}]
    data["pools"]["interactive"]["canary"] = {"eval": {"dataset": "eval.jsonl"}}
    (tmp_path / "conf" / "fleet.yaml").write_text(yaml.safe_dump(data))
    fleet = load_fleet(tmp_path / "conf" / "fleet.yaml")
    want = str(tmp_path / "conf" / "eval.jsonl")
    launch = fleet.pools["interactive"].replicas[0].launch
    assert launch is not None and launch.extra_args() == ["--answer-key", want, "--accuracy", "0.5"]
    eval_spec = fleet.pools["interactive"].canary.eval if fleet.pools["interactive"].canary else None
    assert eval_spec is not None and eval_spec.dataset == want


def test_the_default_fleet_autoscales_its_interactive_pool_on_a_planned_capacity() -> None:
    spec = load_fleet(DEFAULT_FLEET_PATH).pools["interactive"].autoscale
    assert spec is not None and spec.capacity_from == "plan"
    assert load_fleet(DEFAULT_FLEET_PATH).pools["interactive"].sim_preset == "llama-3.1-8b-h100"


def test_a_plan_takes_a_preset_to_measure_or_a_tidal_plan_file() -> None:
    data = minimal()
    data["pools"]["interactive"]["autoscale"] = {
        "capacity_from": "plan",
        "plan": {"file": "plan.json", "tp": 4},
        "learn_capacity": True,
    }
    spec = parse_fleet(data).pools["interactive"].autoscale
    assert spec is not None and spec.planned.file == "plan.json" and spec.planned.tp == 4
    data["pools"]["interactive"]["replicas"][0]["launch"] = {"kind": "sim", "preset": "fast-test"}
    data["pools"]["interactive"]["autoscale"] = {"capacity_from": "plan"}
    spec = parse_fleet(data).pools["interactive"].autoscale
    assert spec is not None and spec.planned.prompt_tokens == (128, 2048) and not spec.learn_capacity


def test_minimal_fleet_gets_defaults() -> None:
    fleet = parse_fleet(minimal())
    assert set(fleet.classes) == {"interactive", "batch"}
    assert fleet.gate.sample_interval_s <= 0.25
    assert fleet.pools["interactive"].replicas[0].base_url == "http://127.0.0.1:9001"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.update(colour="blue"), "colour: unknown key"),
        (lambda d: d["pools"]["interactive"].update(kind="gpu"), "pools.interactive.kind: Input should be"),
        (
            lambda d: d["pools"]["interactive"]["replicas"][0].update(url="ftp://x"),
            "pools.interactive.replicas[0].url: URL scheme should be 'http' or 'https'",
        ),
        (
            lambda d: d["pools"]["interactive"]["replicas"][0].update(wieght=2),
            "pools.interactive.replicas[0].wieght: unknown key",
        ),
        (
            lambda d: d["pools"]["interactive"].update(model="other"),
            "pools.interactive.model: unknown model 'other'",
        ),
        (
            lambda d: d.update(features={"chat": {"class": "fast"}}),
            "features.chat.class: unknown class 'fast'",
        ),
        (
            lambda d: d.update(features={"chat": {"context_cap": -5}}),
            "features.chat.context_cap: Input should be greater than 0",
        ),
        (
            lambda d: d.update(features={"x": {"regulated": True, "pin_external": True}}),
            "features.x: a regulated feature cannot be pinned to the external provider",
        ),
        (
            lambda d: d.update(features={"x": {"pin_external": True}}),
            "features.x.pin_external: no external_provider is configured",
        ),
        (
            lambda d: d.update(gate={"kv_usage_pause": 0.5, "kv_usage_resume": 0.8}),
            "gate: kv_usage_resume must not exceed kv_usage_pause",
        ),
        (
            lambda d: d.update(gate={"sample_interval_s": 1.0}),
            "gate.sample_interval_s: Input should be less than or equal to 0.25",
        ),
        (
            lambda d: d.update(tenants=[{"name": "t", "key_hashes": ["plaintext-key"]}]),
            "tenants[0].key_hashes: key hashes must look like 'sha256:<64 lowercase hex digits>'",
        ),
        (
            lambda d: d.update(tenants=[{"name": "t", "features": ["nope"]}]),
            "tenants[0].features: unknown feature 'nope'",
        ),
        (
            lambda d: d["pools"]["interactive"]["replicas"].append({"name": "r0", "url": "http://h:1"}),
            "replica names: duplicate name 'r0'",
        ),
        (lambda d: d.pop("models"), "models: required key is missing"),
        (
            lambda d: d["pools"]["interactive"]["replicas"][0].update(launch={"kind": "sim"}),
            "pools.interactive.replicas[0].launch: a sim launch needs 'preset'",
        ),
        (
            lambda d: d["pools"]["interactive"].update(canary={"step": 60}),
            "pools.interactive.canary.step: unknown key",
        ),
        (
            lambda d: d["pools"]["interactive"].update(canary={"steps": [0.5, 0.25]}),
            "pools.interactive.canary: steps must be increasing shares strictly between 0 and 1",
        ),
        (
            lambda d: d["pools"]["interactive"].update(canary={"steps": [0.5, 1.0]}),
            "pools.interactive.canary: steps must be increasing shares strictly between 0 and 1",
        ),
        (
            lambda d: d["pools"]["interactive"].update(canary={"group": "stable"}),
            "pools.interactive.canary: group must differ from baseline_group",
        ),
        (
            lambda d: d["pools"]["interactive"].update(
                canary={"eval": {"dataset": "e.jsonl", "scorer": "judge"}}
            ),
            "pools.interactive.canary.eval.scorer",
        ),
        (
            lambda d: d["pools"]["interactive"]["replicas"].extend(
                [
                    {"name": "c1", "url": "http://h:2", "group": "b1"},
                    {"name": "c2", "url": "http://h:3", "group": "b2"},
                ]
            ),
            "pools.interactive: replicas are in several groups besides 'stable' (b1, b2): name the one",
        ),
        (
            lambda d: d["pools"]["interactive"].update(autoscale={"capacity_from": "measured"}),
            "pools.interactive.autoscale.capacity_from: Input should be 'static' or 'plan'",
        ),
        (
            lambda d: d["pools"]["interactive"].update(autoscale={"capacity_from": "plan"}),
            "pools.interactive.autoscale.plan: name a preset to measure or a tidal plan --json file "
            "(no replica of the pool has a sim launch block",
        ),
        (
            lambda d: d["pools"]["interactive"].update(autoscale={"plan": {"preset": "p"}}),
            "pools.interactive.autoscale: 'plan' is only read with capacity_from: plan",
        ),
        (
            lambda d: d["pools"]["interactive"].update(
                autoscale={"capacity_from": "plan", "capacity_rps_per_replica": 3, "plan": {"preset": "p"}}
            ),
            "pools.interactive.autoscale: capacity_from: plan takes the capacity from the plan",
        ),
        (
            lambda d: d["pools"]["interactive"].update(
                autoscale={"capacity_from": "plan", "plan": {"preset": "p", "prompt_tokens": [900, 100]}}
            ),
            "pools.interactive.autoscale.plan: prompt_tokens must be [low, high] with 1 <= low <= high",
        ),
        (
            lambda d: d["pools"]["interactive"].update(
                autoscale={"capacity_from": "plan", "plan": {"preset": "p", "file": "plan.json"}}
            ),
            "pools.interactive.autoscale.plan: give 'file' (a tidal plan --json output) or 'preset'",
        ),
        (
            lambda d: d["pools"]["interactive"].update(
                autoscale={"capacity_from": "plan", "plan": {"preset": "p", "tp": 4}}
            ),
            "pools.interactive.autoscale.plan: 'tp' picks an option of 'file'; it needs 'file'",
        ),
        (
            lambda d: d["pools"]["interactive"].update(
                autoscale={"capacity_from": "plan", "plan": {"preset": "p", "ttft_p95": 1}}
            ),
            "pools.interactive.autoscale.plan.ttft_p95: unknown key",
        ),
    ],
)
def test_bad_fleet_is_rejected_naming_the_key(mutate: Any, expected: str) -> None:
    data = minimal()
    mutate(data)
    with pytest.raises(FleetConfigError) as exc:
        parse_fleet(data, "test.yaml")
    assert expected in str(exc.value), str(exc.value)


def test_duplicate_yaml_keys_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("models: [{name: m}]\nmodels: [{name: n}]\npools: {}\n")
    with pytest.raises(FleetConfigError, match="duplicate key 'models'"):
        load_fleet(path)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    data = minimal(colour="blue", features={"chat": {"class": "fast"}})
    data["pools"]["interactive"]["replicas"][0]["url"] = "nope"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FleetConfigError) as exc:
        load_fleet(path)
    assert "colour: unknown key" in str(exc.value)
    assert "pools.interactive.replicas[0].url" in str(exc.value)


def test_api_keys_are_stored_hashed() -> None:
    stored = hash_api_key("secret-key")
    assert stored.startswith("sha256:") and "secret-key" not in stored
    assert verify_api_key("secret-key", stored)
    assert not verify_api_key("other", stored)


def test_a_pool_with_a_second_replica_group_has_a_canary_group() -> None:
    data = minimal()
    assert parse_fleet(data).pools["interactive"].canary_group is None
    data["pools"]["interactive"]["replicas"].append({"name": "n0", "url": "http://h:2", "group": "next"})
    assert parse_fleet(data).pools["interactive"].canary_group == "next"
    data["pools"]["interactive"]["replicas"].append({"name": "n1", "url": "http://h:3", "group": "other"})
    data["pools"]["interactive"]["canary"] = {"group": "other", "steps": [0.1], "step_s": 30}
    pool = parse_fleet(data).pools["interactive"]
    assert pool.canary_group == "other" and pool.canary is not None and pool.canary.steps == [0.1]


# -- isolation: adapters bound to tenants, pool kinds, regions -----------------------------------


def regional(**overrides: Any) -> dict[str, Any]:
    """Interactive pools in eu-west and us-east, a batch and a spot pool, two tenants."""
    data = minimal(
        pools={
            "eu": {"kind": "interactive", "model": "m", "region": "eu-west"},
            "us": {"kind": "interactive", "model": "m", "region": "us-east"},
            "bulk": {"kind": "batch", "model": "m", "region": "eu-west"},
            "cheap": {"kind": "spot", "model": "m", "region": "eu-west"},
        },
        tenants=[{"name": "acme"}, {"name": "globex"}],
        external_provider={"url": "https://provider.example/v1", "region": "us-east"},
    )
    data.update(overrides)
    return data


ISOLATION_REJECTED = [
    (
        "an adapter bound to an unknown tenant",
        {"adapters": [{"name": "a", "path": "/a", "base_model": "m", "tenants": ["initech"]}]},
        "adapters.a.tenants: unknown tenant 'initech' (known: acme, globex)",
    ),
    (
        "an adapter bound to no tenant at all",
        {"adapters": [{"name": "a", "path": "/a", "base_model": "m", "tenants": []}]},
        "adapters[0].tenants: List should have at least 1 item",
    ),
    (
        "an interactive feature on a batch pool",
        {"features": {"chat": {"class": "interactive", "pool": "bulk"}}},
        "features.chat.pool: 'bulk' is a batch pool (interactive requests are never placed on batch or spot",
    ),
    (
        "an interactive feature on a spot pool",
        {"features": {"chat": {"class": "interactive", "pool": "cheap"}}},
        "features.chat.pool: 'cheap' is a spot pool",
    ),
    (
        "a feature whose pool is outside its regions",
        {"features": {"gdpr": {"pool": "us", "regions": ["eu-west"]}}},
        "features.gdpr.pool: 'us' is in region 'us-east', outside the feature's regions (eu-west)",
    ),
    (
        "a feature pinned to a provider outside its regions",
        {"features": {"gdpr": {"pin_external": True, "regions": ["eu-west"]}}},
        "features.gdpr.pin_external: the external provider is in region 'us-east', outside",
    ),
    (
        "an empty list of regions",
        {"features": {"gdpr": {"regions": []}}},
        "features.gdpr.regions: List should have at least 1 item",
    ),
    (
        "a region that is not a name",
        {"external_provider": {"url": "https://provider.example/v1", "region": "eu west"}},
        "external_provider.region: String should match pattern",
    ),
]


@pytest.mark.parametrize(
    ("case", "overrides", "expected"), ISOLATION_REJECTED, ids=[c[0] for c in ISOLATION_REJECTED]
)
def test_isolation_keys_are_checked_naming_the_key(
    case: str, overrides: dict[str, Any], expected: str
) -> None:
    with pytest.raises(FleetConfigError) as exc:
        parse_fleet(regional(**overrides), "test.yaml")
    assert expected in str(exc.value), str(exc.value)


def test_isolation_keys_load() -> None:
    fleet = parse_fleet(
        regional(
            adapters=[
                {"name": "acme-lora", "path": "/a", "base_model": "m", "tenants": ["acme"]},
                {"name": "shared-lora", "path": "/s", "base_model": "m"},
            ],
            features={
                "gdpr": {"pool": "eu", "regions": ["eu-west"]},
                "global": {"pin_external": True, "regions": ["eu-west", "us-east"]},
            },
            tenants=[{"name": "acme", "features": ["*"]}, {"name": "globex", "features": ["gdpr"]}],
        )
    )
    assert fleet.tenants[0].features == ["*"]
    assert fleet.pools["eu"].region == "eu-west" and fleet.external_provider is not None
    assert fleet.served_models("acme") == {"m", "acme-lora", "shared-lora"}
    assert fleet.served_models("globex") == {"m", "shared-lora"}
    assert fleet.served_models("acme", "/v1/chat/completions") == {"m", "acme-lora", "shared-lora"}
    assert fleet.served_models("acme", "/v1/embeddings") == set()
    assert fleet.adapter_for("acme-lora", "globex") is None
    assert fleet.features["gdpr"].allows_region("eu-west")
    assert not fleet.features["gdpr"].allows_region(None)


@pytest.mark.parametrize(
    ("allowed", "host", "reachable"),
    [
        # never, whatever the configuration: link-local (a cloud's metadata service), multicast,
        # unspecified, also written as IPv4-mapped IPv6
        ([], "169.254.169.254", False),
        (["0.0.0.0/0"], "169.254.169.254", False),
        ([], "[::ffff:169.254.169.254]", False),
        ([], "fe80::1", False),
        ([], "224.0.0.1", False),
        ([], "0.0.0.0", False),
        # nothing configured: any other host
        ([], "10.1.2.3", True),
        ([], "vllm-0.vllm.default.svc.cluster.local", True),
        # configured: only the networks and host name patterns listed
        (["10.0.0.0/8", "*.svc.cluster.local", "127.0.0.1"], "10.200.0.7", True),
        (["10.0.0.0/8", "*.svc.cluster.local", "127.0.0.1"], "127.0.0.1", True),
        (["10.0.0.0/8", "*.svc.cluster.local", "127.0.0.1"], "vllm-0.ns.svc.cluster.local.", True),
        (["10.0.0.0/8", "*.svc.cluster.local", "127.0.0.1"], "VLLM-0.NS.SVC.CLUSTER.LOCAL", True),
        (["10.0.0.0/8", "*.svc.cluster.local", "127.0.0.1"], "192.168.1.9", False),
        (["10.0.0.0/8", "*.svc.cluster.local", "127.0.0.1"], "svc.cluster.local.evil.example", False),
        (["10.0.0.0/8", "*.svc.cluster.local", "127.0.0.1"], "127.0.0.2", False),
        (["10.0.0.0/8"], "::ffff:10.0.0.1", False),  # a network matches its own address family
        (["*"], "10.0.0.1", False),  # a host name pattern never matches an address
    ],
)
def test_replica_hosts_bound_where_run_time_replicas_may_be(
    allowed: list[str], host: str, reachable: bool
) -> None:
    assert GatewaySpec(replica_hosts=allowed).allows_replica_host(host) is reachable


@pytest.mark.parametrize("entry", ["http://10.0.0.1", "10.0.0.0/33", "a b", ""])
def test_replica_hosts_entries_are_networks_or_host_name_patterns(entry: str) -> None:
    with pytest.raises(ValidationError):
        GatewaySpec(replica_hosts=[entry])
