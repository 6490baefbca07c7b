"""Predictive load: a rate learned by hour of week from history, plus a calendar of known events.

:class:`HourOfWeekProfile` keeps, for each of the 168 hours of a week, a high quantile of the
per-minute request rates of each of its last few occurrences, and predicts their median (so the
top of the hour is covered, and one unusual week does not become a weekly habit).
:class:`EventCalendar` knows what history cannot: a sale or a cricket match next Saturday.
:class:`Forecaster` combines them into the peak rate expected over a time window, which is what
a scale decision needs: the load that will arrive before a replica started now is ready.

Times are Unix seconds (wall time); hour 0 of the week is Monday 00:00 at ``utc_offset_s``.

Example::

    profile = HourOfWeekProfile()
    profile.fit(history)                    # [(unix_s, requests_per_s), ...]
    calendar = EventCalendar([ScheduledEvent("final", start, end, multiplier=2.5, lead_s=900)])
    Forecaster(profile, calendar).peak(now, now + 240)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tidal.fleet import ScheduledEventSpec

__all__ = ["EventCalendar", "Forecaster", "HourOfWeekProfile", "ScheduledEvent", "hour_of_week"]

HOUR_S = 3600.0
WEEK_HOURS = 168
# 1970-01-01 was a Thursday: hour 72 of a week that starts on Monday.
_EPOCH_HOUR_OF_WEEK = 72


def hour_of_week(t: float, utc_offset_s: float = 0.0) -> int:
    """0 = Monday 00:00-01:00, 167 = Sunday 23:00-24:00 (local time at ``utc_offset_s``)."""
    return int((math.floor((t + utc_offset_s) / HOUR_S) + _EPOCH_HOUR_OF_WEEK) % WEEK_HOURS)


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class HourOfWeekProfile:
    """Request rate by hour of week, learned from observations (bounded memory).

    Each time an hour of the week ends, its high quantile (``quantile`` of its per-bin mean
    rates) is stored for that hour; the prediction is the **median over the last ``weeks``
    occurrences** of the hour, so one unusual week (a viral spike, an outage) does not move it.

    **Parameters:** ``quantile`` -- which quantile of an hour's rates stands for it (0.9: the top
    of the hour is covered); ``weeks`` -- occurrences remembered per hour; ``resolution_s`` --
    samples are averaged into bins of this length first; ``utc_offset_s`` -- local time.
    """

    def __init__(
        self,
        *,
        quantile: float = 0.9,
        weeks: int = 4,
        resolution_s: float = 60.0,
        utc_offset_s: float = 0.0,
    ) -> None:
        if not 0.0 <= quantile <= 1.0:
            raise ValueError("quantile must be within [0, 1]")
        if weeks < 1 or resolution_s <= 0 or resolution_s > HOUR_S:
            raise ValueError("weeks must be >= 1 and resolution_s within (0, 3600]")
        self.quantile = quantile
        self.weeks = weeks
        self.resolution_s = resolution_s
        self.utc_offset_s = utc_offset_s
        self._buckets: list[deque[float]] = [deque(maxlen=weeks) for _ in range(WEEK_HOURS)]
        self._cache: list[float | None] = [None] * WEEK_HOURS
        self._bin: int | None = None
        self._bin_sum = 0.0
        self._bin_n = 0
        self._hour: int | None = None  # absolute hour number of the occurrence being collected
        self._hour_bins: list[float] = []
        self._closed_upto = -(2**62)  # the last bin already stored; earlier samples are late

    def observe(self, t: float, rps: float) -> None:
        """Add one observation; bins and hours are closed when time moves past them (late samples are dropped)."""
        if not math.isfinite(rps) or rps < 0 or not math.isfinite(t):
            return
        b = math.floor(t / self.resolution_s)
        if (self._bin is not None and b < self._bin) or (self._bin is None and b <= self._closed_upto):
            return
        if self._bin is not None and b != self._bin:
            self._close_bin()
            hour = math.floor((b * self.resolution_s + self.utc_offset_s) / HOUR_S)
            if self._hour is not None and hour != self._hour:
                self._close_hour()
        self._bin = b
        self._bin_sum += rps
        self._bin_n += 1

    def _close_bin(self) -> None:
        if self._bin is None or self._bin_n == 0:
            return
        hour = math.floor((self._bin * self.resolution_s + self.utc_offset_s) / HOUR_S)
        if self._hour is not None and hour != self._hour:
            self._close_hour()
        self._hour = hour
        self._hour_bins.append(self._bin_sum / self._bin_n)
        self._bin_sum, self._bin_n = 0.0, 0
        self._closed_upto = max(self._closed_upto, self._bin)

    def _close_hour(self) -> None:
        if self._hour is None or not self._hour_bins:
            return
        h = int((self._hour + _EPOCH_HOUR_OF_WEEK) % WEEK_HOURS)
        self._buckets[h].append(_quantile(self._hour_bins, self.quantile))
        self._cache[h] = None
        self._hour_bins = []

    def fit(self, history: Iterable[tuple[float, float]]) -> HourOfWeekProfile:
        """Learn from ``(unix_s, requests_per_s)`` pairs in time order; returns ``self``.

        The last (possibly partial) hour is stored too, so ``fit`` on whole hours learns them all.
        """
        for t, rps in history:
            self.observe(t, rps)
        self._close_bin()
        self._close_hour()
        self._bin = None
        self._hour = None
        return self

    def predict_hour(self, hour: int) -> float | None:
        """The learned rate of one hour of the week, or ``None`` if it was never observed."""
        cached = self._cache[hour]
        if cached is None and self._buckets[hour]:
            cached = self._cache[hour] = _quantile(self._buckets[hour], 0.5)
        return cached

    def predict(self, t: float) -> float | None:
        return self.predict_hour(hour_of_week(t, self.utc_offset_s))

    @property
    def trained_hours(self) -> int:
        return sum(1 for b in self._buckets if b)

    def to_json(self) -> dict[str, Any]:
        """Everything learned (one value per hour occurrence), for the scheduler to persist."""
        return {
            "quantile": self.quantile,
            "weeks": self.weeks,
            "resolution_s": self.resolution_s,
            "utc_offset_s": self.utc_offset_s,
            "buckets": [list(b) for b in self._buckets],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HourOfWeekProfile:
        profile = cls(
            quantile=float(data["quantile"]),
            weeks=int(data["weeks"]),
            resolution_s=float(data["resolution_s"]),
            utc_offset_s=float(data.get("utc_offset_s", 0.0)),
        )
        buckets = data["buckets"]
        if not isinstance(buckets, list) or len(buckets) != WEEK_HOURS:
            raise ValueError(f"a profile has {WEEK_HOURS} buckets")
        for h, values in enumerate(buckets):
            for v in values:
                f = float(v)
                if math.isfinite(f) and f >= 0:
                    profile._buckets[h].append(f)
        return profile


@dataclass(frozen=True, slots=True)
class ScheduledEvent:
    """A known event: during ``[start - lead_s, end)`` expect ``multiplier`` x the usual load
    (or at least ``expected_rps``)."""

    name: str
    start: float
    end: float
    multiplier: float | None = None
    expected_rps: float | None = None
    lead_s: float = 900.0

    def __post_init__(self) -> None:
        if self.end <= self.start:
            raise ValueError(f"event {self.name}: end must be after start")
        if self.multiplier is None and self.expected_rps is None:
            raise ValueError(f"event {self.name}: needs a multiplier or an expected rate")

    def overlaps(self, start: float, end: float) -> bool:
        return self.start - self.lead_s <= end and start < self.end

    @classmethod
    def from_spec(cls, spec: ScheduledEventSpec) -> ScheduledEvent:
        return cls(
            name=spec.name,
            start=spec.start.timestamp(),
            end=spec.end.timestamp(),
            multiplier=spec.multiplier,
            expected_rps=spec.expected_rps,
            lead_s=spec.lead_s,
        )


class EventCalendar:
    """The scheduled events of one pool."""

    def __init__(self, events: Iterable[ScheduledEvent] = ()) -> None:
        self.events = sorted(events, key=lambda e: e.start)

    def overlapping(self, start: float, end: float) -> list[ScheduledEvent]:
        return [e for e in self.events if e.overlaps(start, end)]

    def active(self, t: float) -> bool:
        """An event is under way (its lead time does not count): its load is not a usual week's."""
        return any(e.start <= t < e.end for e in self.events)


class Forecaster:
    """The peak request rate expected over a window: learned profile, raised by any known event."""

    def __init__(
        self, profile: HourOfWeekProfile | None = None, calendar: EventCalendar | None = None
    ) -> None:
        self.profile = profile
        self.calendar = calendar or EventCalendar()

    def peak(self, start: float, end: float) -> float | None:
        """Highest expected rate in ``[start, end]``; ``None`` when nothing is known about it."""
        end = max(start, end)
        best: float | None = None
        offset = self.profile.utc_offset_s if self.profile is not None else 0.0
        t = start
        # One slice per hour of week touched: the profile is constant within an hour.
        while True:
            hour_end = (math.floor((t + offset) / HOUR_S) + 1) * HOUR_S - offset
            slice_end = min(end, hour_end)
            base = self.profile.predict(t) if self.profile is not None else None
            value = base
            for ev in self.calendar.overlapping(t, slice_end):
                if ev.multiplier is not None and base is not None:
                    value = max(value or 0.0, base * ev.multiplier)
                if ev.expected_rps is not None:
                    value = max(value or 0.0, ev.expected_rps)
            if value is not None:
                best = value if best is None else max(best, value)
            if slice_end >= end:
                return best
            t = slice_end
