"""Admission: admit, queue (bounded, class priority), overflow or 429 with Retry-After."""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.clock import ManualClock
from tidal.priority.admission import MIN_DRAIN_SAMPLES, Admission, Decision, Outcome


@dataclass
class Slots:
    free: dict[str, int] = field(default_factory=lambda: {"p": 0})

    def free_slots(self, pool: str) -> int:
        return self.free.get(pool, 0)

    over: int = 0

    def over_cap(self, pool: str) -> int:
        return self.over


def make(
    free: int = 0, *, max_queue: int = 4, overflow: bool = False
) -> tuple[Admission, Slots, ManualClock]:
    clock = ManualClock()
    slots = Slots({"p": free})
    return (
        Admission(capacity=slots, clock=clock, max_queue=max_queue, overflow_available=overflow),
        slots,
        clock,
    )


def offer(
    a: Admission, *, priority: int = 0, budget: float = 2.0, regulated: bool = False, cls: str = "interactive"
):  # type: ignore[no-untyped-def]
    return a.offer("p", cls, priority=priority, wait_budget_s=budget, feature="chat", regulated=regulated)


def test_free_slot_admits_at_once_and_reserves_it() -> None:
    # Given one free slot, When two requests arrive, Then the first is admitted, the second queues.
    a, _, _ = make(free=1)
    v1, t1 = offer(a)
    v2, _ = offer(a)
    assert v1.decision is Decision.ADMIT and v2.decision is Decision.QUEUE
    # When the first starts on a replica, its reservation becomes real in-flight (the source's job).
    a.started(t1)
    assert a.outcomes[("interactive", "chat", Outcome.ADMITTED)] == 1
    assert a.outcomes[("interactive", "chat", Outcome.QUEUED)] == 1


def test_waiters_are_woken_by_class_priority_then_fifo() -> None:
    # Given a full pool and waiters of two classes,
    a, slots, _ = make(free=0, max_queue=10)
    _, low1 = offer(a, priority=10, cls="standard")
    _, high1 = offer(a, priority=0)
    _, low2 = offer(a, priority=10, cls="standard")
    _, high2 = offer(a, priority=0)
    # When two slots free, Then both interactive waiters go first, in arrival order.
    slots.free["p"] = 2
    assert a.wake("p") == [high1, high2]
    # When they start and two more slots free, the standard ones follow in order.
    a.started(high1)
    a.started(high2)
    assert a.wake("p") == [low1, low2]
    assert a.queue_depth("p") == 0


def test_full_queue_rejects_with_retry_after_from_the_drain_rate() -> None:
    # Given a saturated pool that finished 10 requests in the last 5 s (2/s) and a full queue,
    a, _, clock = make(free=0, max_queue=4)
    for _ in range(10):
        a.completed("p")
        clock.advance(0.4)
    for _ in range(4):
        assert offer(a, budget=100)[0].decision is Decision.QUEUE
    # When one more arrives, Then it is refused with Retry-After = ceil((4 ahead + 1) / 2 per s) = 3.
    verdict, _ = offer(a)
    assert verdict.decision is Decision.REJECT and verdict.retry_after_s == 3
    assert a.outcomes[("interactive", "chat", Outcome.REJECTED)] == 1
    assert a.queue_depth() == 4  # the queue never grows beyond its limit


def test_unmeetable_budget_overflows_unless_regulated() -> None:
    # Given a pool draining 1 request/s with 3 waiting and a 2 s budget,
    a, _, clock = make(free=0, max_queue=100, overflow=True)
    for _ in range(5):
        a.completed("p")
        clock.advance(1.0)
    for _ in range(3):
        offer(a, budget=60)
    # When a request arrives whose expected wait (4 s) exceeds its budget,
    # Then it overflows to the external provider, except a regulated one, which gets 429.
    assert offer(a, budget=2.0)[0].decision is Decision.OVERFLOW
    regulated, _ = offer(a, budget=2.0, regulated=True)
    assert regulated.decision is Decision.REJECT and regulated.retry_after_s is not None
    assert a.outcomes[("interactive", "chat", Outcome.OVERFLOWED)] == 1


def test_expired_waiters_leave_the_queue() -> None:
    # Given a queued request, When its budget runs out before a slot frees, Then expire() refuses it.
    a, slots, clock = make(free=0)
    _, t = offer(a, budget=1.0)
    clock.advance(1.5)
    verdict = a.expire(t)
    assert verdict is not None and verdict.decision is Decision.REJECT
    assert a.queue_depth("p") == 0
    # A ticket granted before its timer fired proceeds.
    _, t2 = offer(a, budget=1.0)
    slots.free["p"] = 1
    assert a.wake("p") == [t2]
    assert a.expire(t2) is None


def test_late_tickets_are_not_granted_and_withdrawn_ones_free_their_slot() -> None:
    a, slots, clock = make(free=0)
    _, late = offer(a, budget=1.0)
    clock.advance(2.0)
    slots.free["p"] = 1
    assert a.wake("p") == []  # its budget is over: the timer's expire() answers it
    assert a.expire(late) is not None
    v, t = offer(a)
    assert v.decision is Decision.ADMIT
    a.withdraw(t)  # the client left before it started: the slot is free again
    assert offer(a)[0].decision is Decision.ADMIT


def test_queue_wait_quantile_covers_admitted_requests() -> None:
    a, slots, clock = make(free=0)
    _, t = offer(a)
    clock.advance(0.5)
    slots.free["p"] = 1
    a.wake("p")
    assert a.queue_wait_quantile("p", 1.0) == 0.5


def test_a_burst_after_a_calm_spell_queues_until_the_drain_rate_is_measured() -> None:
    # Given a pool that finished one request in the window (0.2/s: the calm, not its capacity)
    a, _, clock = make(free=0, max_queue=100)
    a.completed("p")
    clock.advance(1.0)
    # When a burst arrives whose wait that rate would put far beyond the budget (14 / 0.2 = 70 s)
    verdicts = [offer(a, budget=30)[0].decision for _ in range(14)]
    # Then it queues (each bounded by its deadline) rather than being refused at once
    assert verdicts == [Decision.QUEUE] * 14
    # And once enough completions measure the rate, the expected wait decides again
    for _ in range(MIN_DRAIN_SAMPLES):
        a.completed("p")
    assert a.drain_rate("p") == (MIN_DRAIN_SAMPLES + 1) / 5.0
    assert offer(a, budget=2)[0].decision is Decision.REJECT


# -- fair share across tenants within a class ---------------------------------------------------


def tenants(
    *, policy: str = "fair", weights: dict[str, float] | None = None, max_queue: int = 100, **kw: object
) -> tuple[Admission, Slots, ManualClock]:
    clock = ManualClock()
    slots = Slots({"p": 0})
    w = weights or {}
    a = Admission(
        capacity=slots,
        clock=clock,
        max_queue=max_queue,
        policy=policy,
        weight=lambda t: w.get(t, 1.0),
        **kw,  # type: ignore[arg-type]
    )
    return a, slots, clock


def ask(a: Admission, tenant: str, budget: float = 60.0):  # type: ignore[no-untyped-def]
    return a.offer(
        "p", "interactive", priority=0, wait_budget_s=budget, feature="chat", regulated=False, tenant=tenant
    )


def grant_one_by_one(a: Admission, slots: Slots, n: int) -> list[str]:
    """Free ``n`` slots one at a time; the grants start and hold their slots."""
    out = []
    for _ in range(n):
        slots.free["p"] = 1
        (ticket,) = a.wake("p")
        a.started(ticket)
        slots.free["p"] = 0
        out.append(ticket.tenant)
    return out


def test_a_freed_slot_goes_to_the_tenant_holding_the_fewest() -> None:
    a, slots, _ = tenants()
    for _ in range(10):
        ask(a, "heavy")
    grant_one_by_one(a, slots, 3)  # heavy alone: it gets every slot (work-conserving)
    _, light = ask(a, "light")
    assert grant_one_by_one(a, slots, 1) == ["light"]
    assert light.state == "started"
    # Once the light tenant holds as many as the heavy one, ties go to the oldest waiter.
    for _ in range(3):
        ask(a, "light")
    assert grant_one_by_one(a, slots, 6) == ["light", "light", "heavy", "light", "heavy", "heavy"]
    assert a.held[("p", "light")] + a.held[("p", "heavy")] == 10


def test_slots_go_in_proportion_to_weight_and_free_when_requests_finish() -> None:
    a, slots, _ = tenants(weights={"gold": 2.0})
    tickets = {t: [ask(a, t)[1] for _ in range(30)] for t in ("gold", "bronze")}
    got = grant_one_by_one(a, slots, 30)
    assert got.count("gold") == 20 and got.count("bronze") == 10
    # A finished request gives its tenant's slot back.
    for t in tickets["gold"][:20]:
        a.finished(t)
    assert a.held[("p", "gold")] == 0 and a.held[("p", "bronze")] == 10
    assert grant_one_by_one(a, slots, 5) == ["gold"] * 5


def test_other_gateways_holdings_count() -> None:
    remote = {("p", "busy-elsewhere"): 8}
    a, slots, _ = tenants(remote_inflight=lambda pool, t: remote.get((pool, t), 0))
    for _ in range(4):
        ask(a, "busy-elsewhere")
        ask(a, "quiet")
    assert grant_one_by_one(a, slots, 4) == ["quiet"] * 4


def test_fifo_keeps_one_arrival_order() -> None:
    a, slots, _ = tenants(policy="fifo")
    for _ in range(5):
        ask(a, "heavy")
    ask(a, "light")
    assert grant_one_by_one(a, slots, 6) == ["heavy"] * 5 + ["light"]


def test_a_full_queue_pushes_out_the_tenant_that_queues_the_most() -> None:
    pushed: list[object] = []
    a, _, _ = tenants(max_queue=4, on_push_out=pushed.append)
    heavy = [ask(a, "heavy")[1] for _ in range(4)]
    # Another heavy request is refused: its tenant already queues the most.
    v, _ = ask(a, "heavy")
    assert v.decision is Decision.REJECT and pushed == []
    # A light newcomer takes the place of the heavy tenant's newest waiter.
    v, light = ask(a, "light")
    assert v.decision is Decision.QUEUE and light.state == "waiting"
    assert pushed == [heavy[-1]] and heavy[-1].state == "pushed_out"
    assert heavy[-1].verdict is not None and heavy[-1].verdict.decision is Decision.REJECT
    assert a.queue_depth() == 4 and a.waiting == {"heavy": 3, "light": 1}
    # Without a way to tell a waiter (and with fifo), a full queue refuses the newcomer.
    b, _, _ = tenants(max_queue=1)
    ask(b, "heavy")
    assert ask(b, "light")[0].decision is Decision.REJECT


def test_the_expected_wait_counts_what_fair_order_serves_first() -> None:
    """Behind 40 waiters of a heavy tenant, with 10 completions a second and a 2 s budget: fifo
    predicts 4 s and refuses a light newcomer; fair share serves it after one heavy waiter."""
    for policy, expect in (("fifo", Decision.REJECT), ("fair", Decision.QUEUE)):
        a, slots, clock = tenants(policy=policy)
        for _ in range(MIN_DRAIN_SAMPLES * 2):
            a.completed("p")
            clock.advance(0.1)
        for _ in range(40):
            ask(a, "heavy", budget=60)
        verdict, _ = ask(a, "light", budget=2.0)
        assert verdict.decision is expect, policy


def test_a_tenant_below_its_share_borrows_a_slot_over_the_caps() -> None:
    a, slots, _ = tenants(borrow_slots=2)
    for _ in range(12):
        ask(a, "heavy")
    grant_one_by_one(a, slots, 8)  # heavy holds 8 of 8 slots, 4 more wait
    # The light tenant holds nothing: it does not wait for a heavy request to end.
    v, light = ask(a, "light")
    assert v.decision is Decision.ADMIT and light.state == "granted" and a.borrowed == 1
    a.started(light)
    slots.over = 1  # the replicas now run one over their caps
    assert ask(a, "light")[0].decision is Decision.ADMIT  # still below its share, one more
    slots.over = 2
    assert ask(a, "light")[0].decision is Decision.QUEUE  # the pool is as far over as allowed
    # A tenant alone never borrows (nobody would pay the slot back), nor does the heavy one.
    b, _, _ = tenants(borrow_slots=2)
    for _ in range(3):
        ask(b, "solo")
    assert ask(b, "solo")[0].decision is Decision.QUEUE and b.borrowed == 0
    assert ask(a, "heavy")[0].decision is Decision.QUEUE


def test_borrowing_keeps_class_priority_and_needs_fair_share() -> None:
    for policy, borrow, urgent_waiting in (("fifo", 2, False), ("fair", 0, False), ("fair", 2, True)):
        a, slots, _ = tenants(policy=policy, borrow_slots=borrow)
        for _ in range(3):
            ask(a, "heavy")
        grant_one_by_one(a, slots, 2)
        if urgent_waiting:
            v, _ = a.offer(
                "p", "vip", priority=-1, wait_budget_s=60, feature="chat", regulated=False, tenant="heavy"
            )
            assert v.decision is Decision.QUEUE  # over its share: it waits, and blocks borrowing
        assert ask(a, "light")[0].decision is Decision.QUEUE, (policy, borrow, urgent_waiting)
