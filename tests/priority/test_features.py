"""Feature resolution and the policy a feature applies before admission."""

from __future__ import annotations

from typing import Any

import pytest

from tidal.fleet import FleetConfig, parse_fleet
from tidal.priority.features import (
    PlanError,
    estimate_tokens,
    plan_request,
    resolve_batch_feature,
    resolve_feature,
)


def fleet(**extra: Any) -> FleetConfig:
    data: dict[str, Any] = {
        "models": [{"name": "m"}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": "m",
                "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}],
            },
            "long": {
                "kind": "long_context",
                "model": "m",
                "replicas": [{"name": "r1", "url": "http://127.0.0.1:9"}],
            },
        },
        "features": {
            "chat": {"class": "interactive", "context_cap": 1000},
            "rag": {"class": "interactive", "context_cap": 8000, "long_context_threshold": 2000},
            "hard": {"class": "interactive", "pin_external": True},
            "default": {"class": "interactive"},
        },
        "external_provider": {"url": "http://127.0.0.1:9/v1"},
    }
    data.update(extra)
    return parse_fleet(data)


RESOLVE = [
    ("header wins", "rag", frozenset({"*"}), None, "rag"),
    ("key's only feature", None, frozenset({"chat"}), "chat", "chat"),
    ("fleet default", None, frozenset({"*"}), None, "default"),
]


@pytest.mark.parametrize(
    ("case", "header", "allowed", "key_default", "want"), RESOLVE, ids=[c[0] for c in RESOLVE]
)
def test_resolution(
    case: str, header: str | None, allowed: frozenset[str], key_default: str | None, want: str
) -> None:
    assert resolve_feature(fleet(), header, allowed, key_default) == want


def test_resolution_errors() -> None:
    f = fleet()
    with pytest.raises(PlanError) as e:
        resolve_feature(f, "rag", frozenset({"chat"}), "chat")
    assert e.value.status == 403 and e.value.code == "feature_not_allowed"
    with pytest.raises(PlanError) as e:
        resolve_feature(f, "nope", frozenset({"*"}), None)
    assert e.value.status == 400 and e.value.param == "X-Tidal-Feature"
    no_default = fleet(features={"chat": {"class": "interactive"}, "rag": {"class": "interactive"}})
    with pytest.raises(PlanError) as e:
        resolve_feature(no_default, None, frozenset({"chat", "rag"}), None)
    assert e.value.status == 400 and "X-Tidal-Feature" in e.value.message


def test_context_cap_is_a_400_naming_the_cap() -> None:
    with pytest.raises(PlanError) as e:
        plan_request(fleet(), "chat", model="m", prompt_tokens=900, max_tokens=200)
    assert e.value.status == 400 and "1000" in e.value.message and e.value.code == "context_length_exceeded"
    assert plan_request(fleet(), "chat", model="m", prompt_tokens=800, max_tokens=200).pool == "interactive"


def test_long_prompts_go_to_the_long_context_pool() -> None:
    assert plan_request(fleet(), "rag", model="m", prompt_tokens=1500, max_tokens=None).pool == "interactive"
    assert plan_request(fleet(), "rag", model="m", prompt_tokens=2500, max_tokens=None).pool == "long"


def test_pinned_features_go_external_and_unknown_models_404() -> None:
    plan = plan_request(fleet(), "hard", model="m", prompt_tokens=10, max_tokens=10)
    assert plan.external and plan.pool is None
    with pytest.raises(PlanError) as e:
        plan_request(fleet(), "chat", model="other", prompt_tokens=1, max_tokens=1)
    assert e.value.status == 404


def test_token_estimate() -> None:
    assert estimate_tokens(0) == 0 and estimate_tokens(4000) == 1000


# -- isolation: pool kinds and regions ---------------------------------------------------------


def regional() -> FleetConfig:
    """Model m in eu-west and us-east (interactive, long context, batch, spot); provider in us-east."""
    return parse_fleet(
        {
            "models": [{"name": "m"}, {"name": "bulk-only"}],
            "pools": {
                "us": {"kind": "interactive", "model": "m", "region": "us-east"},
                "eu": {"kind": "interactive", "model": "m", "region": "eu-west"},
                "us-long": {"kind": "long_context", "model": "m", "region": "us-east"},
                "eu-long": {"kind": "long_context", "model": "m", "region": "eu-west"},
                "bulk": {"kind": "batch", "model": "bulk-only", "region": "eu-west"},
                "cheap": {"kind": "spot", "model": "bulk-only", "region": "eu-west"},
            },
            "features": {
                "default": {},
                "gdpr": {"regions": ["eu-west"], "context_cap": 8000, "long_context_threshold": 2000},
                "atlantic": {"regions": ["eu-west", "us-east"]},
                "nowhere": {"regions": ["ap-south"]},
                "claims": {"regulated": True},
            },
            "external_provider": {"url": "http://127.0.0.1:9/v1", "region": "us-east"},
        }
    )


PLACEMENT = [
    # (case, feature, model, prompt tokens, pool, overflow allowed, regions)
    ("no regions: the first interactive pool", "default", "m", 10, "us", True, None),
    ("regions: the pool inside them", "gdpr", "m", 10, "eu", False, {"eu-west"}),
    ("regions: the long-context pool inside them", "gdpr", "m", 3000, "eu-long", False, {"eu-west"}),
    ("provider inside the regions: may overflow", "atlantic", "m", 10, "us", True, {"eu-west", "us-east"}),
    ("regulated: never overflows", "claims", "m", 10, "us", False, None),
]


@pytest.mark.parametrize(
    ("case", "feature", "model", "tokens", "pool", "overflow", "regions"),
    PLACEMENT,
    ids=[c[0] for c in PLACEMENT],
)
def test_placement_stays_inside_the_features_regions(
    case: str, feature: str, model: str, tokens: int, pool: str, overflow: bool, regions: set[str] | None
) -> None:
    plan = plan_request(regional(), feature, model=model, prompt_tokens=tokens, max_tokens=None)
    assert plan.pool == pool
    assert plan.overflow_allowed is overflow
    assert plan.regions == (frozenset(regions) if regions is not None else None)


def test_interactive_requests_never_go_to_batch_or_spot_pools() -> None:
    # Given a model served only by a batch and a spot pool, an interactive request for it is refused
    with pytest.raises(PlanError) as e:
        plan_request(regional(), "default", model="bulk-only", prompt_tokens=10, max_tokens=None)
    assert e.value.status == 400 and e.value.code == "model_not_available"


def test_a_feature_with_no_pool_in_its_regions_is_refused() -> None:
    with pytest.raises(PlanError) as e:
        plan_request(regional(), "nowhere", model="m", prompt_tokens=10, max_tokens=None)
    assert e.value.status == 400 and "ap-south" in e.value.message


BATCH_RESOLVE = [
    # (case, named, allowed, key default, want)
    ("named in metadata", "gdpr", frozenset({"*"}), None, "gdpr"),
    ("the key's only feature", None, frozenset({"gdpr"}), "gdpr", "gdpr"),
    ("the fleet's default when the key may use it", None, frozenset({"*"}), None, "default"),
    ("no feature when the key may use none with regions", None, frozenset({"claims", "x"}), None, None),
]


@pytest.mark.parametrize(
    ("case", "named", "allowed", "key_default", "want"), BATCH_RESOLVE, ids=[c[0] for c in BATCH_RESOLVE]
)
def test_batch_feature_resolution(
    case: str, named: str | None, allowed: frozenset[str], key_default: str | None, want: str | None
) -> None:
    assert resolve_batch_feature(regional(), named, allowed, key_default) == want


def test_batch_feature_resolution_errors() -> None:
    f = regional()
    with pytest.raises(PlanError) as e:
        resolve_batch_feature(f, "gdpr", frozenset({"claims"}), "claims")
    assert e.value.status == 403 and e.value.param == "metadata.feature"
    with pytest.raises(PlanError) as e:
        resolve_batch_feature(f, "nope", frozenset({"*"}), None)
    assert e.value.status == 400 and e.value.code == "unknown_feature"
    # A key with several features, some kept to regions, must say which one a batch is
    with pytest.raises(PlanError) as e:
        resolve_batch_feature(f, None, frozenset({"gdpr", "claims"}), None)
    assert e.value.status == 400 and e.value.code == "feature_required" and "gdpr" in e.value.message
