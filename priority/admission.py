"""Admission: admit, queue (bounded), overflow to the external provider, or refuse with 429.

A library with an injected clock and no I/O, so that the gateway (asyncio futures) and the
routing benchmark (virtual time) run the very same object:

* a request whose pool has a free slot (replica in-flight caps minus slots already granted) and
  no waiter of its class or a more urgent one ahead is **admitted** at once;
* otherwise it **queues** -- FIFO per class, strict class priority (smaller vLLM priority first)
  -- if the gateway queue has room and the wait the pool's measured drain rate predicts fits the
  class's wait budget; a queued request is granted a slot by :meth:`Admission.wake` when one
  frees, or expires at its budget's end. The rate counts as measured once the window holds
  ``MIN_DRAIN_SAMPLES`` completions: a burst after a calm spell, when one or two recent
  completions would predict a wait many times too long, queues and is bounded by its deadline;
* a request that cannot queue or that expired **overflows** to the external provider when one is
  configured and the request may leave (``regulated=False``; the gateway passes ``not
  plan.overflow_allowed``: a regulated feature, or one whose ``regions`` leave out the provider's,
  never does), else is **rejected** with ``Retry-After`` computed from the drain rate (requests
  ahead / completions per second).

Every outcome is counted per class and feature (``admitted``, ``queued``, ``rejected_429``,
``overflowed``, ``context_cap_400``, ``errors``).

Example::

    admission = Admission(capacity=registry, clock=clock, max_queue=256, overflow_available=True)
    verdict, ticket = admission.offer("interactive", "interactive", priority=0, wait_budget_s=2,
                                      feature="chat", regulated=False)
    if verdict.decision is Decision.QUEUE: ...          # wait for wake() or the deadline
    admission.started(ticket); ...; admission.completed("interactive")
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from priority.window import SlidingWindow
from tidal.clock import Clock

__all__ = ["MIN_DRAIN_SAMPLES", "Admission", "CapacitySource", "Decision", "Outcome", "Ticket", "Verdict"]

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
    """Free interactive slots of a pool: sum over routable replicas of ``cap - in-flight``."""

    def free_slots(self, pool: str) -> int: ...


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
    state: str = "new"  # new -> waiting -> granted -> started; or late/expired/withdrawn
    granted_at: float | None = None

    @property
    def waited_s(self) -> float:
        return (self.granted_at if self.granted_at is not None else self.arrived_at) - self.arrived_at


@dataclass
class _PoolQueue:
    by_priority: dict[int, deque[Ticket]] = field(default_factory=dict)
    granted: int = 0  # slots handed out whose requests have not started yet
    size: int = 0

    def ahead_of(self, priority: int) -> int:
        return sum(len(q) for p, q in self.by_priority.items() if p <= priority)


class Admission:
    """Bounded, class-prioritised admission for the interactive pools.

    **Parameters:**

    * ``capacity`` -- where free slots come from (the replica registry).
    * ``clock`` -- time for deadlines and the drain-rate window.
    * ``max_queue`` -- most requests waiting in the gateway, all pools together.
    * ``overflow_available`` -- an external provider is configured.
    * ``window_s`` -- the sliding window of the drain rate and queue-wait statistics.
    * ``on_outcome`` -- called with ``(class, feature, outcome)`` for every counted outcome.
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
    ) -> None:
        self.capacity = capacity
        self.clock = clock
        self.max_queue = max_queue
        self.overflow_available = overflow_available
        self.window_s = window_s
        self.on_outcome = on_outcome
        self.outcomes: Counter[tuple[str, str, Outcome]] = Counter()
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

    def count(self, class_name: str, feature: str, outcome: Outcome) -> None:
        self.outcomes[(class_name, feature, outcome)] += 1
        if self.on_outcome is not None:
            self.on_outcome(class_name, feature, outcome)

    def _available(self, pool: str) -> int:
        return self.capacity.free_slots(pool) - self._pool(pool).granted

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

    def retry_after(self, pool: str, priority: int | None = None, budget_s: float = 1.0) -> int:
        """Seconds until the requests ahead have drained at the measured rate (1 .. 300)."""
        q = self._pool(pool)
        ahead = q.size if priority is None else q.ahead_of(priority)
        rate = self.drain_rate(pool)
        if rate <= 0:
            return max(1, min(300, math.ceil(budget_s)))
        return max(1, min(300, math.ceil((ahead + 1) / rate)))

    # -- the decision ----------------------------------------------------------------------------

    def _refuse(self, ticket: Ticket, budget_s: float, reason: str) -> Verdict:
        if self.overflow_available and not ticket.regulated:
            self.count(ticket.class_name, ticket.feature, Outcome.OVERFLOWED)
            return Verdict(Decision.OVERFLOW, reason=reason)
        self.count(ticket.class_name, ticket.feature, Outcome.REJECTED)
        return Verdict(
            Decision.REJECT,
            retry_after_s=self.retry_after(ticket.pool, ticket.priority, budget_s),
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
    ) -> tuple[Verdict, Ticket]:
        """Decide for a new request: ADMIT (a slot is granted), QUEUE, OVERFLOW or REJECT."""
        now = self.clock.now()
        ticket = Ticket(
            next(self._ids), pool, class_name, priority, feature, regulated, now, now + wait_budget_s, payload
        )
        q = self._pool(pool)
        if self._available(pool) > 0 and q.ahead_of(priority) == 0:
            self._grant(ticket, q, now)
            return Verdict(Decision.ADMIT), ticket
        if self.queued_total >= self.max_queue:
            return self._refuse(ticket, wait_budget_s, "the gateway queue is full"), ticket
        measured = self._drained[pool].count() >= MIN_DRAIN_SAMPLES
        rate = self.drain_rate(pool)
        ahead = q.ahead_of(priority)
        if wait_budget_s <= 0 or (measured and (ahead + 1) / rate > wait_budget_s):
            return self._refuse(ticket, wait_budget_s, "the expected wait exceeds the class's budget"), ticket
        ticket.state = "waiting"
        q.by_priority.setdefault(priority, deque()).append(ticket)
        q.size += 1
        self.queued_total += 1
        self.count(class_name, feature, Outcome.QUEUED)
        return Verdict(Decision.QUEUE), ticket

    def _grant(self, ticket: Ticket, q: _PoolQueue, now: float) -> None:
        ticket.state = "granted"
        ticket.granted_at = now
        q.granted += 1
        self._waits[ticket.pool].add(now - ticket.arrived_at)
        self.count(ticket.class_name, ticket.feature, Outcome.ADMITTED)

    def _unqueue(self, ticket: Ticket, q: _PoolQueue) -> None:
        dq = q.by_priority.get(ticket.priority)
        if dq is not None:
            try:
                dq.remove(ticket)
            except ValueError:
                return
            q.size -= 1
            self.queued_total -= 1

    def wake(self, pool: str) -> list[Ticket]:
        """Grant slots to waiters, most urgent class first, while the pool has free slots; the
        caller dispatches the returned tickets (and must call :meth:`started` or :meth:`release`)."""
        q = self._pools.get(pool)
        if q is None or q.size == 0:
            return []
        now = self.clock.now()
        out: list[Ticket] = []
        while q.size and self._available(pool) > 0:
            prio = min(p for p, dq in q.by_priority.items() if dq)
            ticket = q.by_priority[prio].popleft()
            q.size -= 1
            self.queued_total -= 1
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
            ticket.state = "withdrawn"

    def completed(self, pool: str) -> None:
        """A request on the pool finished (feeds the drain rate); call :meth:`wake` next."""
        self._pool(pool)
        self._drained[pool].add()
