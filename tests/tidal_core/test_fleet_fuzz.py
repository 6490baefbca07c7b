"""Hypothesis on fleet loading: whatever YAML-shaped data a config holds, ``parse_fleet`` either
returns a fleet or raises ``FleetConfigError`` naming the problems, never anything else."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from tidal.fleet import FleetConfigError, parse_fleet

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=12,
)
REPLICA = {"name": "r", "url": "http://127.0.0.1:9"}
# Configs that are nearly right: each section present, absent, or replaced by anything.
configs = (
    st.fixed_dictionaries(
        {},
        optional={
            "models": st.just([{"name": "tiny"}]) | values,
            "pools": st.just({"p": {"kind": "interactive", "model": "tiny", "replicas": [REPLICA]}})
            | st.dictionaries(st.text(max_size=8), values, max_size=2),
            "features": st.dictionaries(st.text(max_size=8), values, max_size=2),
            "tenants": st.lists(values, max_size=2),
            "adapters": st.lists(values, max_size=2),
            "classes": st.dictionaries(st.text(max_size=8), values, max_size=2),
            "gateway": values,
            "gate": values,
            "router": values,
            "external_provider": values,
        },
    )
    | values
)


@given(data=configs)
@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_config_is_a_fleet_or_a_config_error(data: Any) -> None:
    try:
        parse_fleet(data)
    except FleetConfigError as exc:
        assert str(exc).startswith("fleet config")
