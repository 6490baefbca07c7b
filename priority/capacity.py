"""The capped batch: a per-replica in-flight cap that adapts so TPOT p95 stays under the SLO.

Decode is memory-bandwidth bound, so a bigger batch raises a replica's throughput but slows every
user's tokens. The gateway caps the interactive requests it keeps on each replica and moves the
cap by AIMD from the time per output token it measures itself: every ``interval_s``, with at
least ``min_samples`` finished requests, it takes the p95 of their TPOT; above the SLO the cap is
cut by ``decrease`` (multiplicative), below ``headroom`` x SLO while the cap was actually reached
it grows by one (additive). "Above the SLO" means above ``target`` x SLO (0.85): a controller
that only reacts once an interval's p95 has crossed the SLO holds the overall p95 *at* the SLO,
so it aims a margin below it. The cap starts at the pool's ``max_inflight_per_replica`` and stays
within ``[min_inflight_per_replica, max_inflight_per_replica]``.

Example::

    cap = AdaptiveCap(64, minimum=4, maximum=64, slo_s=0.05, clock=clock)
    cap.note_inflight(64)
    for tpot in measured: cap.observe(tpot)
    clock.advance(2.0); cap.observe(0.08)      # p95 above 50 ms: the cap drops to 48
"""

from __future__ import annotations

import math

from tidal.clock import Clock
from tidal.priority.window import quantile

__all__ = ["AdaptiveCap"]


class AdaptiveCap:
    """AIMD on one replica's in-flight cap, from per-request TPOT samples.

    **Parameters:** ``initial``, ``minimum``, ``maximum`` (requests); ``slo_s`` (TPOT p95
    limit); ``target`` (cut above target x SLO); ``interval_s`` between decisions;
    ``min_samples`` per decision; ``decrease`` (multiplicative factor); ``headroom`` (grow only
    while p95 < headroom x SLO).
    """

    def __init__(
        self,
        initial: int,
        *,
        minimum: int,
        maximum: int,
        slo_s: float,
        clock: Clock,
        interval_s: float = 2.0,
        min_samples: int = 8,
        decrease: float = 0.75,
        target: float = 0.85,
        headroom: float = 0.65,
    ) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError("need 1 <= minimum <= maximum")
        self.minimum = minimum
        self.maximum = maximum
        self.value = max(minimum, min(maximum, initial))
        self.slo_s = slo_s
        self.clock = clock
        self.interval_s = interval_s
        self.min_samples = min_samples
        self.decrease = decrease
        self.target = target
        self.headroom = headroom
        self._samples: list[float] = []
        self._peak_inflight = 0
        self._last_decision = clock.now()
        self.last_p95: float | None = None

    def note_inflight(self, inflight: int) -> None:
        """Tell the controller how many requests are on the replica (to know if the cap binds)."""
        if inflight > self._peak_inflight:
            self._peak_inflight = inflight

    def observe(self, tpot_s: float) -> None:
        """Record one finished request's TPOT and decide if an interval has passed."""
        if math.isfinite(tpot_s) and tpot_s >= 0:
            self._samples.append(tpot_s)
        self.maybe_decide()

    def adopt(self, value: int) -> None:
        """Take a cap decided elsewhere (another gateway's controller of the same replica): the
        next decision judges requests that ran under it, as after a decision of this one."""
        self.value = max(self.minimum, min(self.maximum, value))
        self._samples.clear()
        self._peak_inflight = 0
        self._last_decision = self.clock.now()

    def maybe_decide(self) -> int:
        now = self.clock.now()
        if now - self._last_decision < self.interval_s or len(self._samples) < self.min_samples:
            return self.value
        p95 = quantile(self._samples, 0.95)
        self.last_p95 = p95
        if p95 > self.slo_s * self.target:
            self.value = max(self.minimum, min(self.value - 1, math.floor(self.value * self.decrease)))
        elif p95 < self.slo_s * self.headroom and self._peak_inflight >= self.value:
            self.value = min(self.maximum, self.value + 1)
        # Judge the next interval on requests that ran under the new cap.
        self._samples.clear()
        self._peak_inflight = 0
        self._last_decision = now
        return self.value
