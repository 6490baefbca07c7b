"""Feature resolution and the policy a feature applies before admission."""

from __future__ import annotations

from typing import Any

import pytest

from priority.features import PlanError, estimate_tokens, plan_request, resolve_feature
from tidal.fleet import FleetConfig, parse_fleet


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
