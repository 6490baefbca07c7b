"""The registry's replica views: the load the router reads blends the gateway's own count with the
last scrape, without counting twice what the gateway has seen end since that scrape."""

from __future__ import annotations

from tidal.clock import ManualClock
from tidal.priority.capacity import AdaptiveCap
from tidal.replicas.metrics import LoadSnapshot
from tidal.router.registry import ReplicaRegistry, ReplicaState


def _registry() -> tuple[ReplicaRegistry, ReplicaState, ManualClock]:
    clock = ManualClock()
    reg = ReplicaRegistry(clock)
    state = reg.add(
        ReplicaState(
            "r0",
            "http://r0",
            "interactive",
            "m",
            AdaptiveCap(8, minimum=1, maximum=8, slo_s=0.05, clock=clock),
        )
    )
    return reg, state, clock


def _load(reg: ReplicaRegistry) -> float:
    return reg.views("interactive")[0].load


def test_a_request_the_gateway_saw_end_no_longer_counts_before_the_next_scrape() -> None:
    # Given two of this gateway's requests running, as the last scrape also saw,
    reg, state, clock = _registry()
    reg.acquire(state)
    reg.acquire(state)
    reg.update_snapshot("r0", LoadSnapshot(num_running=2.0))
    assert _load(reg) == 2
    # When one ends before the next scrape, the replica counts one, not the scrape's two,
    clock.advance(0.3)
    reg.release(state)
    assert _load(reg) == 1
    # and when the other ends too, none.
    reg.release(state)
    assert _load(reg) == 0


def test_other_gateways_traffic_still_counts() -> None:
    # Given a scrape that saw five requests, one of them this gateway's,
    reg, state, _ = _registry()
    reg.acquire(state)
    reg.update_snapshot("r0", LoadSnapshot(num_running=4.0, num_waiting=1.0))
    # When this gateway's request ends, the other four still count,
    reg.release(state)
    assert _load(reg) == 4
    # and the next scrape starts the count of ended requests afresh.
    reg.update_snapshot("r0", LoadSnapshot(num_running=4.0))
    assert _load(reg) == 4


def test_a_stale_scrape_is_ignored() -> None:
    reg, state, clock = _registry()
    reg.update_snapshot("r0", LoadSnapshot(num_running=6.0))
    reg.acquire(state)
    clock.advance(11.0)
    assert _load(reg) == 1


def test_replicas_are_in_their_pools_region() -> None:
    from tidal.fleet import parse_fleet

    fleet = parse_fleet(
        {
            "models": [{"name": "m"}],
            "pools": {
                "eu": {
                    "kind": "interactive",
                    "model": "m",
                    "region": "eu-west",
                    "replicas": [{"name": "e0", "url": "http://e0"}],
                },
                "any": {
                    "kind": "interactive",
                    "model": "m",
                    "replicas": [{"name": "a0", "url": "http://a0"}],
                },
            },
        }
    )
    reg = ReplicaRegistry.from_fleet(fleet, ManualClock())
    assert [v.region for v in reg.views("eu")] == ["eu-west"]
    assert [v.region for v in reg.views("any")] == [None]


def test_a_view_shows_each_field_of_the_replicas_state() -> None:
    clock = ManualClock(3.0)
    snap = LoadSnapshot(num_running=2.0, running_lora_adapters=frozenset({"b"}))
    state = ReplicaState(
        name="r",
        url="http://r",
        pool="p",
        model="m",
        cap=AdaptiveCap(7, minimum=1, maximum=9, slo_s=0.05, clock=clock),
        group="canary",
        weight=0.5,
        max_loras=3,
        region="eu",
        healthy=False,
        draining=True,
        inflight=4,
        prefill_tokens=100,
        remote_inflight=2,
        remote_prefill_tokens=50,
        snapshot=snap,
        snapshot_at=2.0,
        finished_since_snapshot=1,
        adapters={"a": 1.0},
        clock=clock,
    )
    v = state.view()
    assert (v.name, v.pool, v.model, v.group, v.weight, v.region) == ("r", "p", "m", "canary", 0.5, "eu")
    assert (v.healthy, v.draining, v.inflight, v.cap, v.max_loras) == (False, True, 6, 7, 3)
    assert (v.prefill_tokens, v.finished_since_snapshot) == (150, 1)
    assert v.snapshot is snap and v.snapshot_at == 2.0 and v.snapshot_age_s == 1.0
    assert v.loaded_adapters == frozenset({"a", "b"}) and v.kv_events is None and v.clock is clock


def test_the_pools_version_moves_with_what_filters_read_not_with_load() -> None:
    reg, state, _ = _registry()
    before = reg.views("interactive").version
    # A request's start, first token and end move load only: the filters' cached results stand,
    reg.acquire(state, None, 10)
    reg.first_token(state, 10)
    reg.release(state, tpot_s=0.03)
    state.snapshot_at = 1.0
    assert reg.views("interactive").version == before
    assert reg.views("interactive")[0].inflight == 0
    # while a health change, even after load changes, moves it.
    reg.acquire(state, None, 10)
    state.healthy = False
    pool = reg.views("interactive")
    assert pool.version > before and not pool[0].healthy and pool[0].inflight == 1
