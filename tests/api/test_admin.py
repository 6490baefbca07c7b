"""The admin API contract the scheduler builds on: replicas at run time and the load signal."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient

from tests.api.harness import Gateway
from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.batch_jobs.store import Store, put_runtime_replica, runtime_replicas
from tidal.fleet import FleetConfig, parse_fleet
from tidal.settings import Settings

POOL_KEYS = {
    "queue_depth",
    "queue_wait_p95_s",
    "ttft_p95_s",
    "tpot_p95_s",
    "inflight",
    "kv_cache_usage_max",
    "kv_cache_usage_mean",
    "num_waiting",
    "replicas_healthy",
    "replicas_serving",
    "replicas_total",
    "requests_per_s",
    "error_rate",
}
REPLICA_KEYS = {
    "name",
    "url",
    "pool",
    "group",
    "weight",
    "healthy",
    "draining",
    "inflight",
    "cap",
    "loaded_adapters",
    "snapshot",
    "snapshot_age_s",
    "kv_events",  # its KV-event subscription (null: it publishes none)
}


def test_register_patch_and_remove_a_replica(offline_gateway: Gateway) -> None:
    gw = offline_gateway
    # Given the autoscaler started a replica, When it registers it, Then it is listed with defaults.
    r = gw.admin(
        "POST",
        "/admin/replicas",
        json={"name": "admin-t1", "url": "http://127.0.0.1:9", "pool": "interactive"},
    )
    assert r.status_code == 201, r.text
    assert r.json()["group"] == "stable" and r.json()["weight"] == 1.0 and r.json()["cap"] == 64
    listed = {x["name"]: x for x in gw.admin("GET", "/admin/replicas").json()["data"]}
    assert set(listed["admin-t1"]) == REPLICA_KEYS
    assert gw.admin("GET", "/admin/load").json()["pools"]["interactive"]["replicas_total"] >= 2
    # A second registration under the same name is a conflict.
    dup = gw.admin(
        "POST",
        "/admin/replicas",
        json={"name": "admin-t1", "url": "http://127.0.0.1:9", "pool": "interactive"},
    )
    assert dup.status_code == 409 and dup.json()["error"]["code"] == "replica_exists"
    # A canary rolled back to weight 0 stays healthy but is no longer serving capacity.
    before = gw.admin("GET", "/admin/load").json()["pools"]["interactive"]
    assert before["replicas_serving"] == before["replicas_healthy"]
    gw.admin("PATCH", "/admin/replicas/admin-t1", json={"weight": 0})
    after = gw.admin("GET", "/admin/load").json()["pools"]["interactive"]
    assert after["replicas_healthy"] == before["replicas_healthy"]
    assert after["replicas_serving"] == before["replicas_serving"] - 1
    # Canary weight, draining and health are set independently.
    r = gw.admin("PATCH", "/admin/replicas/admin-t1", json={"weight": 0.05, "draining": True})
    assert r.json()["weight"] == 0.05 and r.json()["draining"] is True and r.json()["healthy"] is True
    r = gw.admin("PATCH", "/admin/replicas/admin-t1", json={"healthy": False})
    assert r.json()["healthy"] is False
    # Deregistration drains first; with nothing in flight it is immediate.
    r = gw.admin("DELETE", "/admin/replicas/admin-t1")
    assert r.status_code == 200 and r.json() == {"name": "admin-t1", "removed": True, "inflight": 0}
    assert gw.admin("DELETE", "/admin/replicas/admin-t1").status_code == 404
    assert gw.admin("PATCH", "/admin/replicas/admin-t1", json={"healthy": True}).status_code == 404


def test_registration_is_validated(offline_gateway: Gateway) -> None:
    gw = offline_gateway
    bad_scheme = gw.admin(
        "POST", "/admin/replicas", json={"name": "x1", "url": "file:///etc/passwd", "pool": "interactive"}
    )
    assert bad_scheme.status_code == 400 and bad_scheme.json()["error"]["param"] == "url"
    no_pool = gw.admin(
        "POST", "/admin/replicas", json={"name": "x2", "url": "http://127.0.0.1:9", "pool": "gpu-9"}
    )
    assert no_pool.status_code == 400 and no_pool.json()["error"]["code"] == "unknown_pool"
    extra = gw.admin("PATCH", "/admin/replicas/replica-0", json={"healthy": True, "colour": "red"})
    assert extra.status_code == 400
    weight = gw.admin("PATCH", "/admin/replicas/replica-0", json={"weight": -1})
    assert weight.status_code == 400
    # A replica the gateway would reach at a link-local address (a cloud's metadata service), by
    # its URL or its KV-event endpoints, is refused, and nothing is registered.
    for body, param in [
        ({"url": "http://169.254.169.254/latest"}, "url"),
        ({"url": "http://[::ffff:169.254.169.254]:80"}, "url"),
        ({"url": "http://0.0.0.0:9"}, "url"),
        (
            {"url": "http://127.0.0.1:9", "kv_events": {"endpoint": "tcp://169.254.169.254:5557"}},
            "kv_events.endpoint",
        ),
    ]:
        r = gw.admin("POST", "/admin/replicas", json={"name": "meta", "pool": "interactive", **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "replica_host_refused", r.text
        assert r.json()["error"]["param"] == param
    assert "meta" not in {x["name"] for x in gw.admin("GET", "/admin/replicas").json()["data"]}


def test_load_signal_shape(offline_gateway: Gateway) -> None:
    load = offline_gateway.admin("GET", "/admin/load").json()
    assert isinstance(load["time"], float)
    assert set(load["pools"]["interactive"]) == POOL_KEYS
    for group in load["groups"].values():
        assert set(group) == {"requests", "errors", "error_rate"}
    profiles = offline_gateway.admin("GET", "/admin/router").json()
    assert profiles["default"] == "tidal" and "llm_d" in profiles["profiles"]


def _one_replica(tmp_path: Path, *, shared: bool = False) -> tuple[FleetConfig, Settings]:
    """A fleet of one interactive replica (``shared``: it also takes batch) and in-process settings."""
    pool: dict[str, Any] = {"kind": "interactive", "model": "tiny", "shared": shared}
    pool["replicas"] = [{"name": "fixed", "url": "http://127.0.0.1:9"}]
    fleet = parse_fleet({"models": [{"name": "tiny"}], "pools": {"interactive": pool}})
    return fleet, Settings(_env_file=None, data_dir=tmp_path, broker_url="memory://")  # type: ignore[call-arg]


def test_replicas_registered_at_run_time_are_recorded_for_the_batch_workers(tmp_path: Path) -> None:
    # Given a gateway with its batch tier's store (SQLite here)
    fleet, settings = _one_replica(tmp_path, shared=True)
    keys = KeyStore()
    keys.add_key("key-admin", Principal("ops", frozenset({"*"}), admin=True))
    admin = {"Authorization": "Bearer key-admin"}
    store = Store.from_url(settings.resolved_database_url)

    def recorded() -> dict[str, tuple[str, str, str]]:
        with store.session() as s:
            return {r.name: (r.pool, r.url, r.group) for r in runtime_replicas(s)}

    with TestClient(create_app(fleet, settings, keys=keys)) as tc:
        # When the autoscaler adds a replica and a canary build is added
        for body in (
            {"name": "scaled-1", "url": "http://127.0.0.1:10/", "pool": "interactive"},
            {"name": "canary-1", "url": "http://127.0.0.1:11", "pool": "interactive", "group": "canary"},
        ):
            assert tc.post("/admin/replicas", headers=admin, json=body).status_code == 201
        # Then both are in the store the workers read; the fleet file's replica is not
        assert recorded() == {
            "scaled-1": ("interactive", "http://127.0.0.1:10", "stable"),
            "canary-1": ("interactive", "http://127.0.0.1:11", "canary"),
        }
        # And a refused registration records nothing
        dup = {"name": "scaled-1", "url": "http://127.0.0.1:12", "pool": "interactive"}
        assert tc.post("/admin/replicas", headers=admin, json=dup).status_code == 409
        assert recorded()["scaled-1"][1] == "http://127.0.0.1:10"
        # And deregistering removes the record (also one this gateway does not know: 404 here)
        # and tells the router, whose indexes drop what they kept of it
        forgotten: list[str] = []
        service = tc.app.state.tidal.interactive  # type: ignore[attr-defined]
        service.router.forget = forgotten.append
        assert tc.delete("/admin/replicas/scaled-1", headers=admin).json()["removed"] is True
        assert forgotten == ["scaled-1"]
        with store.session() as s:
            put_runtime_replica(s, name="left-over", pool="interactive", url="http://127.0.0.1:13")
        assert tc.delete("/admin/replicas/left-over", headers=admin).status_code == 404
        assert set(recorded()) == {"canary-1"}
    store.dispose()


def test_with_shared_load_state_the_load_signal_counts_the_fleet(tmp_path: Path) -> None:
    # Given a gateway whose shared state says the other gateways serve 6 requests/s, 3 of them
    # failing, and hold 4 requests in their queues,
    fleet, settings = _one_replica(tmp_path)
    with TestClient(create_app(fleet, settings, keys=KeyStore())) as tc:
        service = tc.app.state.tidal.interactive  # type: ignore[attr-defined]
        assert service.load_json()["scope"] == "gateway"
        service.shared = SimpleNamespace(
            up=True,
            remote_rates={"interactive": (6.0, 3.0)},
            remote_queued={"interactive": 4},
            age_s=lambda: 0.01,
            ttl_s=2.0,
            gateways=3,
            fleet_counts={"group:canary:requests": 40, "group:canary:errors": 2},
        )
        service.shared.fleet_totals = lambda: service.shared.fleet_counts
        # When the scheduler reads this gateway's load signal,
        load = service.load_json()
        # Then it answers for the fleet: the others' rates and queues count.
        pool = load["pools"]["interactive"]
        assert load["scope"] == "fleet" and load["shared_state"]["gateways"] == 3
        assert pool["requests_per_s"] == 6.0 and pool["error_rate"] == 0.5 and pool["queue_depth"] == 4
        # and for the fleet's canary counts,
        canary = {k: load["groups"]["canary"][k] for k in ("requests", "errors")}
        assert load["groups_scope"] == "fleet" and canary == {"requests": 40, "errors": 2}
        # Once the others' counts are older than the ttl (the store away), it counts its own alone,
        # but the groups' counts stay the fleet's (the last totals, plus what it counts meanwhile).
        service.shared.up = False
        service.shared.age_s = lambda: 2.5
        load = service.load_json()
        assert load["scope"] == "gateway" and load["pools"]["interactive"]["requests_per_s"] == 0.0
        assert load["groups_scope"] == "fleet" and load["groups"]["canary"]["requests"] == 40
        service.shared = None
