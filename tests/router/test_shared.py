"""Shared load state between gateways: the sync logic with an injected clock and an in-memory store
that keeps the Redis store's rules (expiry by ttl, compare-and-set caps); the Redis store itself is
tested against a real Redis in ``test_redis_load.py``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from tidal.clock import ManualClock
from tidal.priority.admission import Admission, Decision, Ticket
from tidal.priority.capacity import AdaptiveCap
from tidal.router.registry import ReplicaRegistry, ReplicaState
from tidal.router.shared import (
    CapProposal,
    GatewayLoad,
    SharedCap,
    SharedLoad,
    StoreUnavailable,
    SyncReply,
)

pytestmark = pytest.mark.anyio

TTL = 2.0


class Store:
    """What every gateway sees: published loads with their time, caps with their epochs."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.loads: dict[str, tuple[GatewayLoad, float]] = {}
        self.caps: dict[str, SharedCap] = {}
        self.counts: dict[str, int] = {}
        self.down = False


class StoreClient:
    """One gateway's connection to :class:`Store` (the LoadStore protocol)."""

    def __init__(self, store: Store, gateway_id: str) -> None:
        self.store = store
        self.gateway_id = gateway_id

    async def sync(
        self,
        mine: GatewayLoad,
        proposals: Sequence[CapProposal],
        replicas: Sequence[str],
        increments: Mapping[str, int] | None = None,
    ) -> SyncReply:
        s = self.store
        if s.down:
            raise StoreUnavailable("down")
        now = s.clock.now()
        for name, n in (increments or {}).items():
            s.counts[name] = s.counts.get(name, 0) + n
        s.loads[self.gateway_id] = (mine, now)
        accepted = set()
        for p in proposals:
            held = s.caps.get(p.replica)
            if held is None or held.epoch == p.expected_epoch:
                s.caps[p.replica] = SharedCap(p.value, max(held.epoch if held else -1, p.expected_epoch) + 1)
                accepted.add(p.replica)
        live = {g: v for g, v in s.loads.items() if now - v[1] < TTL}
        others = {g: load for g, (load, _) in live.items() if g != self.gateway_id}
        ages = {g: now - t for g, (_, t) in live.items() if g != self.gateway_id}
        caps = {r: s.caps[r] for r in replicas if r in s.caps}
        return SyncReply(others, ages, caps, frozenset(accepted), dict(s.counts))

    async def leave(self) -> None:
        self.store.loads.pop(self.gateway_id, None)

    async def aclose(self) -> None:
        pass


def _gateway(
    store: Store, name: str, cap: int = 8, freed: list[str] | None = None
) -> tuple[ReplicaRegistry, SharedLoad]:
    clock = store.clock
    reg = ReplicaRegistry(clock)
    for r in ("r0", "r1"):
        reg.add(
            ReplicaState(
                r,
                f"http://{r}",
                "interactive",
                "m",
                AdaptiveCap(cap, minimum=1, maximum=cap, slo_s=0.05, clock=clock),
            )
        )
    shared = SharedLoad(
        reg,
        StoreClient(store, name),
        clock=clock,
        interval_s=0.05,
        ttl_s=TTL,
        on_freed=freed.append if freed is not None else None,
    )
    return reg, shared


def _view(reg: ReplicaRegistry, name: str) -> tuple[int, int]:
    v = next(v for v in reg.views("interactive") if v.name == name)
    return v.inflight, v.prefill_tokens


async def test_each_gateway_sees_the_others_in_flight_requests_after_a_sync() -> None:
    # Given two gateways sharing a store,
    store = Store(ManualClock())
    reg_a, a = _gateway(store, "a")
    reg_b, b = _gateway(store, "b")
    # When gateway a starts three requests on r0 (one still prefilling 100 tokens) and both sync,
    for tokens in (0, 0, 100):
        reg_a.acquire(reg_a.get("r0"), prompt_tokens=tokens)  # type: ignore[arg-type]
    await a.sync_once()
    await b.sync_once()
    # Then b routes on them and has five free slots left of r0's eight,
    assert _view(reg_b, "r0") == (3, 100)
    assert reg_b.free_slots("interactive") == 5 + 8
    # while a counts its own once.
    await a.sync_once()
    assert _view(reg_a, "r0") == (3, 100)


async def test_the_cap_holds_for_all_gateways_together() -> None:
    # Given a replica whose cap is 2, one request on it at gateway a, a sync on both,
    store = Store(ManualClock())
    reg_a, a = _gateway(store, "a", cap=2)
    reg_b, b = _gateway(store, "b", cap=2)
    reg_a.remove("r1")
    reg_b.remove("r1")
    reg_a.acquire(reg_a.get("r0"))  # type: ignore[arg-type]
    await a.sync_once()
    await b.sync_once()
    # When gateway b offers two requests, it admits one and queues the other,
    admission = Admission(capacity=reg_b, clock=store.clock)
    first, t1 = admission.offer("interactive", "c", priority=0, wait_budget_s=5, feature="f", regulated=True)
    assert first.decision is Decision.ADMIT
    admission.started(t1)
    reg_b.acquire(reg_b.get("r0"))  # type: ignore[arg-type]
    second, _ = admission.offer("interactive", "c", priority=0, wait_budget_s=5, feature="f", regulated=True)
    assert second.decision is Decision.QUEUE


async def test_a_slot_freed_at_another_gateway_wakes_this_ones_queue() -> None:
    store = Store(ManualClock())
    reg_a, a = _gateway(store, "a")
    freed: list[str] = []
    _, b = _gateway(store, "b", freed=freed)
    state = reg_a.get("r0")
    assert state is not None
    reg_a.acquire(state)
    await a.sync_once()
    await b.sync_once()
    assert freed == []
    # When gateway a's request ends and nothing takes its slot there for an interval,
    reg_a.release(state)
    await a.sync_once()  # (the peak since the last publication: still taken)
    await b.sync_once()
    assert freed == []
    await a.sync_once()
    await b.sync_once()
    # Then b wakes its waiting requests of that pool.
    assert freed == ["interactive"]


async def test_a_slot_freed_and_taken_again_within_an_interval_never_looks_free() -> None:
    # Given gateway a's request on r0, seen by b,
    store = Store(ManualClock())
    reg_a, a = _gateway(store, "a")
    freed: list[str] = []
    reg_b, b = _gateway(store, "b", freed=freed)
    state = reg_a.get("r0")
    assert state is not None
    reg_a.acquire(state)
    await a.sync_once()
    await b.sync_once()
    # When it ends and a's client's next request takes the slot before a publishes again,
    reg_a.release(state)
    reg_a.acquire(state)
    for _ in range(3):
        await a.sync_once()
        await b.sync_once()
    # Then b never saw a free slot there.
    assert freed == [] and _view(reg_b, "r0")[0] == 1


async def test_a_dead_gateways_counts_expire_and_a_clean_stop_withdraws_them_at_once() -> None:
    store = Store(ManualClock())
    reg_a, a = _gateway(store, "a")
    reg_b, b = _gateway(store, "b")
    reg_c, c = _gateway(store, "c")
    reg_a.acquire(reg_a.get("r0"))  # type: ignore[arg-type]
    reg_c.acquire(reg_c.get("r1"))  # type: ignore[arg-type]
    for g in (a, c, b):
        await g.sync_once()
    assert _view(reg_b, "r0")[0] == 1 and _view(reg_b, "r1")[0] == 1
    # When c stops cleanly, its request no longer counts at the next sync,
    await c.leave()
    await b.sync_once()
    assert _view(reg_b, "r1")[0] == 0
    # and when a dies (stops publishing), its request counts until its counts expire (ttl).
    store.clock.advance(TTL - 0.1)
    await b.sync_once()
    assert _view(reg_b, "r0")[0] == 1
    store.clock.advance(0.2)
    await b.sync_once()
    assert _view(reg_b, "r0")[0] == 0 and b.gateways == 1


async def test_without_the_store_a_gateway_serves_on_its_own_counts_and_rejoins() -> None:
    # Given two gateways in sync, a's two requests seen by b,
    clock = ManualClock()
    store = Store(clock)
    reg_a, a = _gateway(store, "a")
    reg_b, b = _gateway(store, "b")
    reg_a.acquire(reg_a.get("r0"))  # type: ignore[arg-type]
    reg_a.acquire(reg_a.get("r0"))  # type: ignore[arg-type]
    await a.sync_once()
    await b.sync_once()
    assert b.up and b.age_s() == 0.0
    # When the store goes away, b says so at once and keeps the counts it read for a while,
    store.down = True
    clock.advance(0.5)
    assert not await b.sync_once()
    assert not b.up and b.age_s() == pytest.approx(0.5)
    assert _view(reg_b, "r0")[0] == 2
    # then, once they are older than the ttl, routes on its own counts only;
    clock.advance(TTL)
    await b.sync_once()
    assert _view(reg_b, "r0")[0] == 0 and reg_b.free_slots("interactive") == 16
    # when the store comes back (empty, as after a restart), both rejoin at their next sync.
    store.down = False
    store.loads.clear()
    await a.sync_once()
    await b.sync_once()
    assert b.up and _view(reg_b, "r0")[0] == 2


async def test_the_oldest_the_view_got_is_reported_at_each_sync() -> None:
    clock = ManualClock()
    store = Store(clock)
    _, a = _gateway(store, "a")
    seen: list[tuple[float, float | None]] = []
    _, b = _gateway(store, "b")
    b.on_sync = lambda took, before: seen.append((took, before))
    await a.sync_once()
    clock.advance(0.03)
    await b.sync_once()  # a's data is 30 ms old at the store
    clock.advance(0.05)
    assert b.age_s() == pytest.approx(0.08)
    await b.sync_once()
    assert seen[0][1] is None
    assert seen[1][1] == pytest.approx(0.08)


async def test_a_cap_decision_at_one_gateway_becomes_every_gateways_cap() -> None:
    clock = ManualClock()
    store = Store(clock)
    reg_a, a = _gateway(store, "a", cap=8)
    reg_b, b = _gateway(store, "b", cap=8)
    await a.sync_once()
    await b.sync_once()
    # When gateway a measures TPOT over the SLO and cuts r0's cap (8 -> 6),
    cap_a = reg_a.get("r0").cap  # type: ignore[union-attr]
    for _ in range(8):
        cap_a.observe(0.2)
    clock.advance(2.0)
    cap_a.observe(0.2)
    assert cap_a.value == 6
    await a.sync_once()
    # Then b adopts it at its next sync and judges its next interval from there.
    await b.sync_once()
    cap_b = reg_b.get("r0").cap  # type: ignore[union-attr]
    assert cap_b.value == 6
    assert reg_b.get("r1").cap.value == 8  # type: ignore[union-attr]


async def test_two_gateways_deciding_at_once_keep_one_decision() -> None:
    # Given both gateways at cap 8 (epoch 0),
    clock = ManualClock()
    store = Store(clock)
    reg_a, a = _gateway(store, "a", cap=8)
    reg_b, b = _gateway(store, "b", cap=8)
    await a.sync_once()
    await b.sync_once()
    # When both cut r0 in the same interval, a to 6 and b to 5, and a reaches the store first,
    reg_a.get("r0").cap.adopt(6)  # type: ignore[union-attr]
    reg_b.get("r0").cap.adopt(5)  # type: ignore[union-attr]
    await a.sync_once()
    await b.sync_once()
    await a.sync_once()
    # Then b's decision, made from a cap that no longer holds, loses: both run a's.
    assert reg_a.get("r0").cap.value == reg_b.get("r0").cap.value == 6  # type: ignore[union-attr]
    assert store.caps["r0"] == SharedCap(6, 1)


async def test_a_cap_decided_while_the_store_was_away_is_published_when_it_returns() -> None:
    clock = ManualClock()
    store = Store(clock)
    reg_a, a = _gateway(store, "a", cap=8)
    reg_b, b = _gateway(store, "b", cap=8)
    await a.sync_once()
    await b.sync_once()
    store.down = True
    reg_a.get("r0").cap.adopt(4)  # type: ignore[union-attr]
    assert not await a.sync_once()
    # When the store comes back empty, a's pending decision lands and b adopts it.
    store.down = False
    store.caps.clear()
    await a.sync_once()
    await b.sync_once()
    assert reg_b.get("r0").cap.value == 4  # type: ignore[union-attr]


def test_the_interval_must_be_shorter_than_the_ttl() -> None:
    store = Store(ManualClock())
    with pytest.raises(ValueError):
        SharedLoad(
            ReplicaRegistry(store.clock), StoreClient(store, "a"), clock=store.clock, interval_s=2, ttl_s=2
        )


async def test_a_tenant_s_share_counts_what_it_holds_through_every_gateway() -> None:
    """Two replicas of 5 slots: tenant "big" holds 5 through gateway a; at gateway b "small"
    holds 4 and "other" 1. When other's slot frees, b gives it to "small" (4 held) before "big"
    (none held at b, 5 through a): fair share is of the pool, not of one gateway."""
    store = Store(ManualClock())
    reg_a, a = _gateway(store, "a", cap=5)
    reg_b, b = _gateway(store, "b", cap=5)
    at_a = Admission(capacity=reg_a, clock=store.clock)
    a.tenant_load = lambda: at_a.held
    at_b = Admission(
        capacity=reg_b, clock=store.clock, remote_inflight=lambda pool, t: b.remote_tenants.get((pool, t), 0)
    )

    def take(adm: Admission, reg: ReplicaRegistry, replica: str, tenant: str) -> Ticket:
        verdict, ticket = adm.offer(
            "interactive", "c", priority=0, wait_budget_s=5, feature="f", regulated=True, tenant=tenant
        )
        assert verdict.decision is Decision.ADMIT
        adm.started(ticket)
        reg.acquire(reg.get(replica))  # type: ignore[arg-type]
        return ticket

    for _ in range(5):
        take(at_a, reg_a, "r0", "big")
    await a.sync_once()
    await b.sync_once()
    assert b.remote_tenants == {("interactive", "big"): 5}
    for _ in range(4):
        take(at_b, reg_b, "r1", "small")
    other = take(at_b, reg_b, "r1", "other")
    _, big = at_b.offer(
        "interactive", "c", priority=0, wait_budget_s=5, feature="f", regulated=True, tenant="big"
    )
    _, small = at_b.offer(
        "interactive", "c", priority=0, wait_budget_s=5, feature="f", regulated=True, tenant="small"
    )
    assert big.state == small.state == "waiting"
    reg_b.release(reg_b.get("r1"))  # type: ignore[arg-type]
    at_b.finished(other)
    assert at_b.wake("interactive") == [small]


async def test_every_gateway_reads_the_fleet_s_request_and_error_rates() -> None:
    # Given three gateways sharing a store, each with its own request and error rates per pool,
    store = Store(ManualClock())
    gateways = [_gateway(store, name)[1] for name in ("a", "b", "c")]
    rates = {"a": (10.0, 1.0), "b": (4.0, 0.0), "c": (0.0, 0.0)}
    for g in gateways:
        g.pool_rates = lambda mine=rates[g.store.gateway_id]: {"interactive": mine}  # type: ignore[misc]
    # When all sync (twice: the first ones read before the others published),
    for _ in range(2):
        for g in gateways:
            await g.sync_once()
    # Then each reads the others' rates, summed (an idle gateway publishes none),
    assert gateways[0].remote_rates == {"interactive": (4.0, 0.0)}
    assert gateways[1].remote_rates == {"interactive": (10.0, 1.0)}
    assert gateways[2].remote_rates == {"interactive": (14.0, 1.0)}
    assert gateways[2]._mine().rates == {}


async def test_counters_add_up_over_gateways_whichever_is_asked_and_survive_an_outage() -> None:
    # Given two gateways counting a canary group's requests, each its own,
    store = Store(ManualClock())
    a, b = (_gateway(store, name)[1] for name in ("a", "b"))
    mine = {"a": {"group:canary:requests": 0}, "b": {"group:canary:requests": 0}}
    a.counters, b.counters = (lambda: mine["a"]), (lambda: mine["b"])
    assert a.fleet_totals() is None  # (nothing read yet)
    # When both count and sync,
    mine["a"]["group:canary:requests"], mine["b"]["group:canary:requests"] = 30, 12
    await a.sync_once()
    await b.sync_once()
    await a.sync_once()
    # Then either answers with the fleet's total, each increment delivered once,
    assert a.fleet_totals()["group:canary:requests"] == b.fleet_totals()["group:canary:requests"] == 42
    # And while the store is away a gateway goes on adding what it counts, and what it counted
    # meanwhile reaches the store with its next sync.
    store.down = True
    mine["a"]["group:canary:requests"] = 35
    assert not await a.sync_once()
    assert a.fleet_totals()["group:canary:requests"] == 47
    store.down = False
    assert await a.sync_once() and await b.sync_once()
    assert store.counts == {"group:canary:requests": 47}
    assert b.fleet_totals()["group:canary:requests"] == 47
    # A gateway that restarts (its counters from zero) adds to the total instead of taking from it.
    a2 = _gateway(store, "a2")[1]
    a2.counters = lambda: {"group:canary:requests": 2}
    await a2.sync_once()
    assert a2.fleet_totals()["group:canary:requests"] == 49
