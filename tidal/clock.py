"""Injected time.

Everything time-based (control loops, the gate, the simulator, admission's drain rate) takes a
``Clock``; tests drive a ``ManualClock`` instead of sleeping.

Example::

    clock = ManualClock()
    gate = BatchGate(config, clock=clock)
    clock.advance(0.25)
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock", "WallClock"]


class Clock(Protocol):
    """Monotonic seconds plus an awaitable sleep on the same time line."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Real monotonic time."""

    # The C function itself, not a method calling it: hot paths call ``clock.now`` per token.
    now = staticmethod(time.monotonic)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class WallClock:
    """Real wall-clock time (Unix seconds), for timestamps users see, e.g. a batch's ``expires_at``.

    A :class:`ManualClock` started at a Unix time stands in for it in tests.
    """

    now = staticmethod(time.time)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that only moves when told to; sleepers wake when ``advance`` passes their deadline."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + max(0.0, seconds), next(self._seq), fut))
        await fut

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def advance_and_settle(self, seconds: float, step: float | None = None) -> None:
        """Advance in steps, yielding to the event loop after each so woken tasks run."""
        step = step or seconds
        remaining = seconds
        while remaining > 1e-12:
            d = min(step, remaining)
            self.advance(d)
            remaining -= d
            for _ in range(5):
                await asyncio.sleep(0)
