"""Sliding-window statistics on an injected clock: quantiles of recent samples and event rates.

Example::

    ttft = SlidingWindow(5.0, clock)
    ttft.add(0.21)
    ttft.quantile(0.95), ttft.rate()
"""

from __future__ import annotations

import math
from collections import deque

from tidal.clock import Clock

__all__ = ["SlidingWindow", "quantile"]


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (``nan`` when empty)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class SlidingWindow:
    """Samples of the last ``window_s`` seconds, at most ``max_samples`` (oldest dropped first)."""

    def __init__(self, window_s: float, clock: Clock, max_samples: int = 20_000) -> None:
        self.window_s = window_s
        self.clock = clock
        self._items: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float = 1.0) -> None:
        self._items.append((self.clock.now(), value))

    def _trim(self) -> None:
        horizon = self.clock.now() - self.window_s
        items = self._items
        while items and items[0][0] < horizon:
            items.popleft()

    def values(self) -> list[float]:
        self._trim()
        return [v for _, v in self._items]

    def count(self) -> int:
        self._trim()
        return len(self._items)

    def total(self) -> float:
        self._trim()
        return sum(v for _, v in self._items)

    def rate(self) -> float:
        """Samples per second over the window."""
        return self.count() / self.window_s

    def quantile(self, q: float) -> float:
        return quantile(self.values(), q)
