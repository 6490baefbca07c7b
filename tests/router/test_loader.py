"""Profiles from the fleet config's router: section load strictly; built-ins are always there."""

from __future__ import annotations

from typing import Any

import pytest

from tidal.fleet import RouterSpec
from tidal.router.framework import Router
from tidal.router.loader import RouterConfigError, build_router, check_router
from tidal.router.plugins.register import REGISTRY
from tidal.router.profiles import BUILTIN_PROFILES
from tidal.router.types import ReplicaView, RouteRequest, RouteResult

VIEWS = [ReplicaView(f"r{i}", model="m") for i in range(4)]


def test_builtin_profiles_exist_without_config() -> None:
    router = build_router(None, seed=0)
    assert router.default == "tidal"
    assert set(BUILTIN_PROFILES) == {
        "tidal",
        "round_robin",
        "least_load",
        "power_of_two",
        "sglang_cache_aware",
        "llm_d",
    }
    for name in BUILTIN_PROFILES:
        assert (
            router.route(RouteRequest("m", prefix_key=1, prefix_blocks=(1, 2)), VIEWS, profile=name)
            is not None
        )


def test_every_registered_type_builds_with_defaults() -> None:
    for type_name, factory in REGISTRY.items():
        plugin = factory(type_name, {})
        assert type_name == plugin.TYPE and plugin.name == type_name


GOOD: dict[str, Any] = {
    "plugins": [
        {"type": "healthy-filter", "name": "healthy"},
        {"type": "prefix-ring", "parameters": {"balance_factor": 2.0, "virtual_nodes": 50}},
        {"type": "prefix-affinity-scorer", "name": "prefix"},
        {"type": "least-inflight-scorer", "name": "load"},
        {"type": "max-score-picker", "name": "max"},
    ],
    "profiles": [
        {
            "name": "mine",
            "plugins": [{"ref": "healthy"}, {"ref": "prefix", "weight": 3}, {"ref": "load"}, {"ref": "max"}],
        }
    ],
    "default_profile": "mine",
}


def test_a_config_profile_uses_its_configured_producer() -> None:
    router = build_router(RouterSpec.model_validate(GOOD), seed=0)
    assert router.default == "mine"
    prof = router.profiles["mine"]
    assert [p.TYPE for p in prof.producers] == ["prefix-ring"]
    assert prof.producers[0].params.balance_factor == 2.0  # type: ignore[attr-defined]
    assert [w for _, w in prof.scorers] == [3.0, 1.0]
    assert "tidal" in router.profiles  # built-ins stay available


def _bad(mutate: Any) -> list[str]:
    import copy

    spec = copy.deepcopy(GOOD)
    mutate(spec)
    return check_router(spec)


BAD_CASES = [
    (
        "unknown type",
        lambda s: s["plugins"].append({"type": "nope-scorer"}),
        "router.plugins[5].type: unknown type 'nope-scorer'",
    ),
    (
        "duplicate name",
        lambda s: s["plugins"].append({"type": "queue-scorer", "name": "load"}),
        "router.plugins[5].name: duplicate name 'load'",
    ),
    (
        "unknown parameter",
        lambda s: s["plugins"][1]["parameters"].update(virtual=3),
        "router.plugins[1].parameters: plugin 'prefix-ring' (type prefix-ring): virtual: unknown parameter",
    ),
    (
        "bad value",
        lambda s: s["plugins"][1]["parameters"].update(balance_factor=0.5),
        "router.plugins[1].parameters: plugin 'prefix-ring' (type prefix-ring): balance_factor:",
    ),
    (
        "missing ref",
        lambda s: s["profiles"][0]["plugins"].append({"ref": "ghost"}),
        "router.profiles[0].plugins[4].ref: unknown plugin 'ghost'",
    ),
    (
        "producer in a profile",
        lambda s: s["profiles"][0]["plugins"].append({"ref": "prefix-ring"}),
        "router.profiles[0].plugins[4].ref: 'prefix-ring' is a producer",
    ),
    (
        "no picker",
        lambda s: s["profiles"][0]["plugins"].pop(),
        "router.profiles[0]: needs exactly one picker, has 0",
    ),
    (
        "two pickers",
        lambda s: s["profiles"][0]["plugins"].append({"ref": "max"}),
        "router.profiles[0]: needs exactly one picker, has 2",
    ),
    (
        "built-in name taken",
        lambda s: s["profiles"][0].update(name="tidal"),
        "router.profiles[0].name: duplicate profile name 'tidal'",
    ),
    (
        "unknown default",
        lambda s: s.update(default_profile="fast"),
        "router.default_profile: unknown profile 'fast'",
    ),
]


@pytest.mark.parametrize(("case", "mutate", "message"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_configs_name_the_key(case: str, mutate: Any, message: str) -> None:
    problems = _bad(mutate)
    assert any(p.startswith(message) for p in problems), problems


def test_build_raises_with_every_problem() -> None:
    with pytest.raises(RouterConfigError) as err:
        build_router({"plugins": [{"type": "x"}, {"type": "y"}], "profiles": []})
    assert "router config is invalid" in str(err.value) and len(err.value.problems) == 2


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.decisions: list[tuple[str, RouteResult | None]] = []

    def plugin_timed(self, kind: str, type_: str, name: str, seconds: float) -> None:
        assert seconds >= 0
        self.calls.append((kind, type_, name))

    def decided(self, profile: str, result: RouteResult | None) -> None:
        self.decisions.append((profile, result))


def test_every_plugin_call_is_timed_and_labelled() -> None:
    rec = Recorder()
    router: Router = build_router(None, seed=0, observer=rec)
    router.route(RouteRequest("m", prefix_key=9), VIEWS)
    kinds = {(k, t) for k, t, _ in rec.calls}
    assert ("filter", "healthy-filter") in kinds and ("producer", "kv-index") in kinds
    assert ("scorer", "load-scorer") in kinds and ("picker", "max-score-picker") in kinds
    assert rec.decisions[0][0] == "tidal" and rec.decisions[0][1] is not None


def test_no_candidate_gives_none_and_exclude_works() -> None:
    router = build_router(None, seed=0)
    assert router.route(RouteRequest("m"), [ReplicaView("a", model="m", healthy=False)]) is None
    result = router.route(RouteRequest("m"), VIEWS, exclude={"r0", "r1", "r2"})
    assert result is not None and result.replica.name == "r3"


def test_fleet_check_reports_router_problems(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from tidal.cli import cli

    bad = tmp_path / "fleet.yaml"
    bad.write_text(
        "models: [{name: m}]\n"
        "pools: {p: {kind: interactive, model: m}}\n"
        "router: {plugins: [{type: magic-scorer}], profiles: [], default_profile: tidal}\n"
    )
    result = CliRunner().invoke(cli, ["fleet", "check", str(bad)])
    assert result.exit_code == 1
    assert "router.plugins[0].type: unknown type 'magic-scorer'" in result.output


REGIONAL = [
    ReplicaView("eu-0", model="m", region="eu-west"),
    ReplicaView("us-0", model="m", region="us-east"),
    ReplicaView("us-1", model="m", region="us-east"),
    ReplicaView("none-0", model="m"),
]


@pytest.mark.parametrize("profile", [*BUILTIN_PROFILES, "mine"])
def test_every_profile_keeps_a_request_inside_its_regions_retries_too(profile: str) -> None:
    # Given a built-in profile, or a config profile that lists no region-filter
    router = build_router(RouterSpec.model_validate(GOOD), seed=0)
    eu = RouteRequest("m", prefix_key=1, prefix_blocks=(1, 2), regions=frozenset({"eu-west"}))
    # When a request kept to eu-west is routed, and retried after its first replica failed
    first = router.route(eu, REGIONAL, profile=profile)
    retry = router.route(eu, REGIONAL, profile=profile, exclude={"eu-0"})
    # Then only the eu-west replica serves it, and the retry finds none rather than leave
    assert first is not None and first.replica.name == "eu-0"
    assert retry is None
    anywhere = router.route(RouteRequest("m"), REGIONAL, profile=profile, exclude={"eu-0"})
    assert anywhere is not None and anywhere.replica.name != "eu-0"


def test_a_profile_listing_a_region_filter_runs_it_once() -> None:
    spec = {
        "plugins": [
            {"type": "region-filter", "name": "residency"},
            {"type": "round-robin-picker", "name": "rr"},
        ],
        "profiles": [{"name": "rr", "plugins": [{"ref": "rr"}, {"ref": "residency"}]}],
    }
    prof = build_router(spec, seed=0).profiles["rr"]
    assert [f.name for f in prof.filters] == ["residency"]
