"""Admission: admit, queue (bounded), overflow to the external provider, or refuse with 429.

A library with an injected clock and no I/O, so that the gateway (asyncio futures) and the
routing benchmark (virtual time) run the very same object:

* a request whose pool has a free slot (replica in-flight caps minus slots already granted) and
  no waiter of its class or a more urgent one ahead is **admitted** at once;
* otherwise it **queues** -- strict class priority (smaller vLLM priority first), and within a
  class **fair across tenants** -- if the gateway queue has room and the wait the pool's measured
  drain rate predicts fits the class's wait budget; a queued request is granted a slot by
  :meth:`Admission.wake` when one frees, or expires at its budget's end. The rate counts as measured once the window holds
  ``MIN_DRAIN_SAMPLES`` completions: a burst after a calm spell, when one or two recent
  completions would predict a wait many times too long, queues and is bounded by its deadline;
* a request that cannot queue or that expired **overflows** to the external provider when one is
  configured and the request may leave (``regulated=False``; the gateway passes ``not
  plan.overflow_allowed``: a regulated feature, or one whose ``regions`` leave out the provider's,
  never does), else is **rejected** with ``Retry-After`` computed from the drain rate (requests
  ahead / completions per second).

**Fair share within a class** (``policy="fair"``, the default): each tenant waits in its own
arrival-order queue, and a freed slot goes to the waiting tenant holding the fewest slots of the
pool per unit of weight -- its requests admitted here and not finished, plus what the other
gateways report (``remote_inflight``, from :mod:`router.shared`), so that a tenant's share is of
the pool, not of one gateway. It is work-conserving: a tenant alone gets every slot, and a
tenant that asks for less than its share gets all it asks for (max-min fairness over slots).
The wait predicted for a newcomer counts only the requests the fair order serves before it, and
when the gateway queue is full a newcomer whose tenant queues less than its share pushes out the
newest waiter of the tenant that queues the most per weight (``on_push_out`` tells that waiter).
A tenant below its share does not even wait for another's request to end: it may **borrow** a
slot over the pool's caps, at most ``borrow_slots`` over them at a time, which the pool pays
back as the next slot frees (the over-share tenant's next request waits for it instead).
``policy="fifo"`` is the earlier behaviour, one arrival order per class, kept as a baseline.

Every outcome is counted per class and feature (``admitted``, ``queued``, ``rejected_429``,
``overflowed``, ``context_cap_400``, ``errors``).

Example::

    admission = Admission(capacity=registry, clock=clock, max_queue=256, overflow_available=True)
    verdict, ticket = admission.offer("interactive", "interactive", priority=0, wait_budget_s=2,
                                      feature="chat", regulated=False, tenant="acme")
    if verdict.decision is Decision.QUEUE: ...          # wait for wake() or the deadline
    admission.started(ticket); ...; admission.completed("interactive"); admission.finished(ticket)
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from tidal.clock import Clock
from tidal.priority.window import SlidingWindow

__all__ = [
    "MIN_DRAIN_SAMPLES",
    "POLICIES",
    "Admission",
    "CapacitySource",
    "Decision",
    "Outcome",
    "Ticket",
    "Verdict",
]

POLICIES = ("fair", "fifo")

# Completions in the window before the drain rate may refuse a request on its expected wait.
MIN_DRAIN_SAMPLES = 5


class Decision(StrEnum):
    ADMIT = "admit"
    QUEUE = "queue"
    OVERFLOW = "overflow"
    REJECT = "reject"


class Outcome(StrEnum):
    """What happened to a request, as counted per class and feature."""

    ADMITTED = "admitted"
    QUEUED = "queued"
    REJECTED = "rejected_429"
    OVERFLOWED = "overflowed"
    CONTEXT_CAP = "context_cap_400"
    ERRORS = "errors"


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: Decision
    retry_after_s: int | None = None
    reason: str = ""


class CapacitySource(Protocol):
    """Free interactive slots of a pool: sum over routable replicas of ``cap - in-flight``; and
    how far its replicas are over their caps (sum of ``in-flight - cap`` where positive)."""

    def free_slots(self, pool: str) -> int: ...

    def over_cap(self, pool: str) -> int: ...


@dataclass(eq=False)
class Ticket:
    """One request's place in admission. ``payload`` is the caller's (a future, a sim request)."""

    id: int
    pool: str
    class_name: str
    priority: int
    feature: str
    regulated: bool
    arrived_at: float
    deadline: float
    payload: Any = None
    tenant: str = ""
    # new -> waiting -> granted -> started -> finished; or late/expired/withdrawn/pushed_out
    state: str = "new"
    granted_at: float | None = None
    verdict: Verdict | None = None  # why a waiting ticket was pushed out

    @property
    def waited_s(self) -> float:
        return (self.granted_at if self.granted_at is not None else self.arrived_at) - self.arrived_at


@dataclass
class _Level:
    """The waiters of one class priority in one pool: per tenant, in arrival order."""

    by_tenant: dict[str, deque[Ticket]] = field(default_factory=dict)
    size: int = 0

    def push(self, ticket: Ticket) -> None:
        self.by_tenant.setdefault(ticket.tenant, deque()).append(ticket)
        self.size += 1

    def remove(self, ticket: Ticket) -> bool:
        dq = self.by_tenant.get(ticket.tenant)
        if dq is None:
            return False
        try:
            dq.remove(ticket)
        except ValueError:
            return False
        if not dq:
            del self.by_tenant[ticket.tenant]
        self.size -= 1
        return True

    def pop(self, tenant: str) -> Ticket:
        dq = self.by_tenant[tenant]
        ticket = dq.popleft()
        if not dq:
            del self.by_tenant[tenant]
        self.size -= 1
        return ticket


@dataclass
class _PoolQueue:
    by_priority: dict[int, _Level] = field(default_factory=dict)
    granted: int = 0  # slots handed out whose requests have not started yet
    size: int = 0

    def ahead_of(self, priority: int) -> int:
        return sum(level.size for p, level in self.by_priority.items() if p <= priority)


class Admission:
    """Bounded, class-prioritised admission for the interactive pools.

    **Parameters:**

    * ``capacity`` -- where free slots come from (the replica registry).
    * ``clock`` -- time for deadlines and the drain-rate window.
    * ``max_queue`` -- most requests waiting in the gateway, all pools together.
    * ``overflow_available`` -- an external provider is configured.
    * ``window_s`` -- the sliding window of the drain rate and queue-wait statistics.
    * ``on_outcome`` -- called with ``(class, feature, outcome)`` for every counted outcome.
    * ``policy`` -- ``"fair"`` across tenants within a class, or ``"fifo"`` (see the module doc).
    * ``weight`` -- a tenant's weight (default: 1 for every tenant).
    * ``remote_inflight`` -- ``(pool, tenant)`` -> the tenant's requests on the pool through the
      other gateways (default: none; this gateway's own counts are kept here).
    * ``on_push_out`` -- called with a waiting ticket pushed out of a full queue (its
      ``verdict`` says what became of it); without it a full queue refuses the newcomer.
    * ``on_tenant_outcome`` -- called with ``(tenant, outcome)`` for every request's outcome.
    * ``borrow_slots`` -- how far over its caps a pool may go for tenants below their share
      (fair policy; 0: never).
    """

    def __init__(
        self,
        *,
        capacity: CapacitySource,
        clock: Clock,
        max_queue: int = 256,
        overflow_available: bool = False,
        window_s: float = 5.0,
        on_outcome: Callable[[str, str, Outcome], None] | None = None,
        policy: str = "fair",
        weight: Callable[[str], float] | None = None,
        remote_inflight: Callable[[str, str], int] | None = None,
        on_push_out: Callable[[Ticket], None] | None = None,
        on_tenant_outcome: Callable[[str, Outcome], None] | None = None,
        borrow_slots: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown admission policy '{policy}' (known: {', '.join(POLICIES)})")
        self.capacity = capacity
        self.clock = clock
        self.max_queue = max_queue
        self.overflow_available = overflow_available
        self.window_s = window_s
        self.on_outcome = on_outcome
        self.fair = policy == "fair"
        self.weight = weight or (lambda _tenant: 1.0)
        self.remote_inflight = remote_inflight
        self.on_push_out = on_push_out
        self.on_tenant_outcome = on_tenant_outcome
        self.borrow_slots = borrow_slots
        self.borrowed = 0  # grants made over the caps (a count, for metrics and tests)
        self.outcomes: Counter[tuple[str, str, Outcome]] = Counter()
        # Per (pool, tenant): requests granted here and not finished; per tenant: waiting here.
        self.held: Counter[tuple[str, str]] = Counter()
        self.waiting: Counter[str] = Counter()
        self._pools: dict[str, _PoolQueue] = {}
        self._drained: dict[str, SlidingWindow] = {}
        self._waits: dict[str, SlidingWindow] = {}
        self._ids = itertools.count(1)
        self.queued_total = 0

    # -- bookkeeping -----------------------------------------------------------------------------

    def _pool(self, pool: str) -> _PoolQueue:
        q = self._pools.get(pool)
        if q is None:
            q = self._pools[pool] = _PoolQueue()
            self._drained[pool] = SlidingWindow(self.window_s, self.clock)
            self._waits[pool] = SlidingWindow(self.window_s, self.clock)
        return q

    def count(self, class_name: str, feature: str, outcome: Outcome, tenant: str | None = None) -> None:
        self.outcomes[(class_name, feature, outcome)] += 1
        if self.on_outcome is not None:
            self.on_outcome(class_name, feature, outcome)
        if tenant is not None and self.on_tenant_outcome is not None:
            self.on_tenant_outcome(tenant, outcome)

    def _available(self, pool: str) -> int:
        return self.capacity.free_slots(pool) - self._pool(pool).granted

    def _holding(self, pool: str, tenant: str) -> int:
        """Slots of ``pool`` the tenant holds, all gateways together."""
        held = self.held[(pool, tenant)]
        if self.remote_inflight is not None:
            held += self.remote_inflight(pool, tenant)
        return held

    def _share(self, pool: str, tenant: str) -> float:
        """What the tenant holds of ``pool`` per unit of its weight."""
        return self._holding(pool, tenant) / self.weight(tenant)

    def _next_tenant(self, pool: str, level: _Level) -> str:
        """Whose waiter a freed slot goes to: the fewest slots held per weight (fair), or the
        oldest waiter (fifo); ties go to the oldest waiter."""
        if not self.fair:
            return min(level.by_tenant, key=lambda t: level.by_tenant[t][0].id)
        return min(level.by_tenant, key=lambda t: (self._share(pool, t), level.by_tenant[t][0].id))

    def _ahead(self, q: _PoolQueue, priority: int, tenant: str) -> int:
        """Waiters served before a newcomer of ``tenant``: every more urgent one, and at its own
        priority, with fair share, each other tenant's up to its weight's worth of the
        newcomer's place in its own queue."""
        ahead = sum(level.size for p, level in q.by_priority.items() if p < priority)
        level = q.by_priority.get(priority)
        if level is None:
            return ahead
        if not self.fair:
            return ahead + level.size
        mine = len(level.by_tenant.get(tenant, ()))
        w = self.weight(tenant)
        for other, dq in level.by_tenant.items():
            if other != tenant:
                ahead += min(len(dq), math.ceil((mine + 1) * self.weight(other) / w))
        return ahead + mine

    # -- statistics ------------------------------------------------------------------------------

    def queue_depth(self, pool: str | None = None) -> int:
        if pool is None:
            return self.queued_total
        q = self._pools.get(pool)
        return q.size if q else 0

    def drain_rate(self, pool: str) -> float:
        """Requests the pool finished per second over the window."""
        self._pool(pool)
        return self._drained[pool].rate()

    def queue_wait_quantile(self, pool: str, q: float = 0.95) -> float:
        """Quantile of the time admitted requests waited (0 for those admitted at once)."""
        self._pool(pool)
        return self._waits[pool].quantile(q)

    def retry_after(
        self, pool: str, priority: int | None = None, budget_s: float = 1.0, tenant: str | None = None
    ) -> int:
        """Seconds until the requests ahead have drained at the measured rate (1 .. 300)."""
        q = self._pool(pool)
        if priority is None:
            ahead = q.size
        elif tenant is None:
            ahead = q.ahead_of(priority)
        else:
            ahead = self._ahead(q, priority, tenant)
        rate = self.drain_rate(pool)
        if rate <= 0:
            return max(1, min(300, math.ceil(budget_s)))
        return max(1, min(300, math.ceil((ahead + 1) / rate)))

    # -- the decision ----------------------------------------------------------------------------

    def _refuse(self, ticket: Ticket, budget_s: float, reason: str) -> Verdict:
        if self.overflow_available and not ticket.regulated:
            self.count(ticket.class_name, ticket.feature, Outcome.OVERFLOWED, ticket.tenant)
            return Verdict(Decision.OVERFLOW, reason=reason)
        self.count(ticket.class_name, ticket.feature, Outcome.REJECTED, ticket.tenant)
        return Verdict(
            Decision.REJECT,
            retry_after_s=self.retry_after(ticket.pool, ticket.priority, budget_s, ticket.tenant),
            reason=reason,
        )

    def offer(
        self,
        pool: str,
        class_name: str,
        *,
        priority: int,
        wait_budget_s: float,
        feature: str,
        regulated: bool,
        payload: Any = None,
        tenant: str = "",
    ) -> tuple[Verdict, Ticket]:
        """Decide for a new request: ADMIT (a slot is granted), QUEUE, OVERFLOW or REJECT."""
        now = self.clock.now()
        ticket = Ticket(
            next(self._ids),
            pool,
            class_name,
            priority,
            feature,
            regulated,
            now,
            now + wait_budget_s,
            payload,
            tenant,
        )
        q = self._pool(pool)
        if (self._available(pool) > 0 and q.ahead_of(priority) == 0) or self._may_borrow(
            q, pool, priority, tenant
        ):
            self._grant(ticket, q, now)
            return Verdict(Decision.ADMIT), ticket
        if self.queued_total >= self.max_queue and not self._push_out_for(tenant):
            return self._refuse(ticket, wait_budget_s, "the gateway queue is full"), ticket
        measured = self._drained[pool].count() >= MIN_DRAIN_SAMPLES
        rate = self.drain_rate(pool)
        ahead = self._ahead(q, priority, tenant)
        if wait_budget_s <= 0 or (measured and (ahead + 1) / rate > wait_budget_s):
            return self._refuse(ticket, wait_budget_s, "the expected wait exceeds the class's budget"), ticket
        ticket.state = "waiting"
        q.by_priority.setdefault(priority, _Level()).push(ticket)
        q.size += 1
        self.queued_total += 1
        self.waiting[tenant] += 1
        self.count(class_name, feature, Outcome.QUEUED, tenant)
        return Verdict(Decision.QUEUE), ticket

    def _may_borrow(self, q: _PoolQueue, pool: str, priority: int, tenant: str) -> bool:
        """Whether a newcomer of ``tenant`` takes a slot over the caps: fair policy, nobody more
        urgent waiting, the pool less than ``borrow_slots`` over its caps, and the tenant below
        its share of what the pool's tenants hold (and no waiting tenant further below it)."""
        if not self.fair or self.borrow_slots <= 0:
            return False
        if any(level.size for p, level in q.by_priority.items() if p < priority):
            return False
        over = self.capacity.over_cap(pool) + max(0, q.granted - self.capacity.free_slots(pool))
        if over >= self.borrow_slots:
            return False
        level = q.by_priority.get(priority)
        waiting = set(level.by_tenant) if level is not None else set()
        holders = {t for (p, t), n in self.held.items() if p == pool and n > 0}
        tenants = holders | waiting | {tenant}
        total = sum(self._holding(pool, t) for t in tenants)
        fair_level = (total + 1) / sum(self.weight(t) for t in tenants)
        mine = self._share(pool, tenant) + 1 / self.weight(tenant)
        if mine > fair_level or not any(self._share(pool, u) > mine for u in tenants if u != tenant):
            return False  # not below its share, or nobody above it to pay the slot back
        if any(self._share(pool, t) < self._share(pool, tenant) for t in waiting if t != tenant):
            return False
        self.borrowed += 1
        return True

    def _push_out_for(self, tenant: str) -> bool:
        """With the queue full, make room for a newcomer of ``tenant`` when it queues less than
        its share: the newest waiter of the tenant queueing the most per weight leaves (its
        verdict set, ``on_push_out`` told). ``False`` when nobody should leave for it."""
        if not self.fair or self.on_push_out is None or not self.waiting:
            return False
        victim = max(self.waiting, key=lambda t: self.waiting[t] / self.weight(t))
        if (self.waiting[tenant] + 1) / self.weight(tenant) >= self.waiting[victim] / self.weight(victim):
            return False
        newest: Ticket | None = None
        for q in self._pools.values():
            for level in q.by_priority.values():
                dq = level.by_tenant.get(victim)
                if dq and (newest is None or dq[-1].id > newest.id):
                    newest = dq[-1]
        if newest is None:
            return False
        self._unqueue(newest, self._pools[newest.pool])
        newest.state = "pushed_out"
        newest.verdict = self._refuse(
            newest, newest.deadline - newest.arrived_at, "the gateway queue is full"
        )
        self.on_push_out(newest)
        return True

    def _grant(self, ticket: Ticket, q: _PoolQueue, now: float) -> None:
        ticket.state = "granted"
        ticket.granted_at = now
        q.granted += 1
        self.held[(ticket.pool, ticket.tenant)] += 1
        self._waits[ticket.pool].add(now - ticket.arrived_at)
        self.count(ticket.class_name, ticket.feature, Outcome.ADMITTED, ticket.tenant)

    def _unqueue(self, ticket: Ticket, q: _PoolQueue) -> None:
        level = q.by_priority.get(ticket.priority)
        if level is not None and level.remove(ticket):
            q.size -= 1
            self.queued_total -= 1
            self._unwait(ticket.tenant)

    def _unwait(self, tenant: str) -> None:
        self.waiting[tenant] -= 1
        if self.waiting[tenant] <= 0:
            del self.waiting[tenant]

    def _unhold(self, ticket: Ticket) -> None:
        key = (ticket.pool, ticket.tenant)
        self.held[key] -= 1
        if self.held[key] <= 0:
            del self.held[key]

    def wake(self, pool: str) -> list[Ticket]:
        """Grant slots to waiters, most urgent class first, while the pool has free slots; the
        caller dispatches the returned tickets (and must call :meth:`started` or :meth:`release`)."""
        q = self._pools.get(pool)
        if q is None or q.size == 0:
            return []
        now = self.clock.now()
        out: list[Ticket] = []
        while q.size and self._available(pool) > 0:
            prio = min(p for p, level in q.by_priority.items() if level.size)
            level = q.by_priority[prio]
            ticket = level.pop(self._next_tenant(pool, level))
            q.size -= 1
            self.queued_total -= 1
            self._unwait(ticket.tenant)
            if now > ticket.deadline:
                # Its budget ran out while nobody looked: leave it for expire().
                ticket.state = "late"
                continue
            self._grant(ticket, q, now)
            out.append(ticket)
        return out

    def expire(self, ticket: Ticket) -> Verdict | None:
        """The ticket's wait budget ran out: take it out of the queue and overflow or refuse it.
        ``None`` when it was granted meanwhile (the caller then proceeds)."""
        if ticket.state == "granted":
            return None
        q = self._pool(ticket.pool)
        if ticket.state == "waiting":
            self._unqueue(ticket, q)
        ticket.state = "expired"
        return self._refuse(ticket, ticket.deadline - ticket.arrived_at, "waited the whole budget")

    def withdraw(self, ticket: Ticket) -> None:
        """The client went away: drop a waiting ticket, or return a granted slot."""
        q = self._pool(ticket.pool)
        if ticket.state == "waiting":
            self._unqueue(ticket, q)
        elif ticket.state == "granted":
            q.granted -= 1
            self._unhold(ticket)
        elif ticket.state == "started":
            self._unhold(ticket)
        ticket.state = "withdrawn"

    def started(self, ticket: Ticket) -> None:
        """The granted request now runs on a replica: its slot is counted there from now on."""
        if ticket.state == "granted":
            self._pool(ticket.pool).granted -= 1
            ticket.state = "started"

    def release(self, ticket: Ticket) -> None:
        """A granted request that will not run (its dispatch failed): give the slot back."""
        if ticket.state == "granted":
            self._pool(ticket.pool).granted -= 1
            self._unhold(ticket)
            ticket.state = "withdrawn"

    def finished(self, ticket: Ticket) -> None:
        """The request that ``ticket`` admitted is over (answered, failed or abandoned): its
        tenant no longer holds the slot. Call it once per started ticket; others are no-ops."""
        if ticket.state == "started":
            self._unhold(ticket)
            ticket.state = "finished"

    def completed(self, pool: str) -> None:
        """A request on the pool finished (feeds the drain rate); call :meth:`wake` next."""
        self._pool(pool)
        self._drained[pool].add()
