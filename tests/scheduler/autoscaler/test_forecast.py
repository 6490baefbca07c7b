"""Predictive load: the hour-of-week profile and the calendar of scheduled events."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tidal.fleet import ScheduledEventSpec
from tidal.scheduler.autoscaler.forecast import (
    EventCalendar,
    Forecaster,
    HourOfWeekProfile,
    ScheduledEvent,
    hour_of_week,
)

MONDAY = datetime(2024, 1, 1, tzinfo=UTC).timestamp()  # a Monday, 00:00 UTC
H = 3600.0
WEEK = 168 * H


@pytest.mark.parametrize(
    ("t", "offset", "hour"),
    [
        (0.0, 0.0, 72),  # 1970-01-01 was a Thursday
        (MONDAY, 0.0, 0),
        (MONDAY + 20.5 * H, 0.0, 20),
        (MONDAY - 1.0, 0.0, 167),  # Sunday 23:59:59
        (MONDAY, 5.5 * H, 5),  # 05:30 in India
        (MONDAY, -H, 167),
    ],
)
def test_hour_of_week(t: float, offset: float, hour: int) -> None:
    assert hour_of_week(t, offset) == hour


def weeks_of(
    rate_at: object, weeks: int, start: float = MONDAY, step: float = 60.0
) -> list[tuple[float, float]]:
    n = int(weeks * WEEK / step)
    return [(start + i * step, rate_at(start + i * step)) for i in range(n)]  # type: ignore[operator]


def test_the_profile_learns_each_hour_of_the_week() -> None:
    # Given two weeks where the rate is the hour of the day (and doubled on Saturdays)
    def rate(t: float) -> float:
        h = hour_of_week(t)
        return float(h % 24) * (2.0 if 120 <= h < 144 else 1.0)

    profile = HourOfWeekProfile().fit(weeks_of(rate, 2))
    # Then it predicts each hour, next week too
    assert profile.trained_hours == 168
    assert profile.predict(MONDAY + 2 * WEEK + 20 * H + 600) == pytest.approx(20.0)
    assert profile.predict(MONDAY + 2 * WEEK + 5 * 24 * H + 20 * H) == pytest.approx(40.0)


def test_a_one_off_burst_in_history_does_not_become_a_weekly_habit() -> None:
    # Given four weeks at 10 rps, with a 5-minute burst to 100 rps on one Monday at 20:00
    def rate(t: float) -> float:
        burst = MONDAY + WEEK + 20 * H
        return 100.0 if burst <= t < burst + 300 else 10.0

    profile = HourOfWeekProfile(quantile=0.9, weeks=4).fit(weeks_of(rate, 4))
    assert profile.predict(MONDAY + 20 * H) == pytest.approx(10.0)


def test_the_profile_remembers_only_the_last_weeks_and_drops_late_samples() -> None:
    profile = HourOfWeekProfile(weeks=1)
    profile.fit(weeks_of(lambda t: 5.0 if t < MONDAY + WEEK else 7.0, 2))
    assert profile.predict(MONDAY) == pytest.approx(7.0)
    profile.observe(MONDAY, 1000.0)  # far in the past: ignored
    profile.fit([])
    assert profile.predict(MONDAY) == pytest.approx(7.0)


def test_the_profile_survives_a_round_trip_through_json() -> None:
    profile = HourOfWeekProfile(utc_offset_s=3600).fit(weeks_of(lambda t: float(hour_of_week(t, 3600)), 1))
    again = HourOfWeekProfile.from_json(profile.to_json())
    for h in (0, 50, 167):
        assert again.predict_hour(h) == profile.predict_hour(h)
    with pytest.raises(ValueError):
        HourOfWeekProfile.from_json({**profile.to_json(), "buckets": [[]] * 3})


def test_the_forecast_peak_covers_every_hour_the_window_touches() -> None:
    profile = HourOfWeekProfile().fit(weeks_of(lambda t: float(hour_of_week(t) % 24), 1))
    f = Forecaster(profile)
    # 19:58 + 4 minutes reaches into the 20:00 hour
    assert f.peak(MONDAY + 19 * H + 58 * 60, MONDAY + 20 * H + 2 * 60) == pytest.approx(20.0)
    assert f.peak(MONDAY + 19 * H, MONDAY + 19 * H) == pytest.approx(19.0)
    assert Forecaster().peak(MONDAY, MONDAY + H) is None


def test_a_scheduled_event_raises_the_forecast_from_its_lead_time_to_its_end() -> None:
    # Given a flat 10 rps history and a match at 14:00-17:00 announced with a 15-minute lead
    profile = HourOfWeekProfile().fit(weeks_of(lambda t: 10.0, 1))
    start = MONDAY + WEEK + 14 * H
    match = ScheduledEvent("cricket", start, start + 3 * H, multiplier=2.5, lead_s=900)
    f = Forecaster(profile, EventCalendar([match]))
    # Then a window ending before the lead sees the usual load, and one reaching into it the event
    assert f.peak(start - 1800, start - 901) == pytest.approx(10.0)
    assert f.peak(start - 1800, start - 899) == pytest.approx(25.0)
    assert f.peak(start + H, start + H) == pytest.approx(25.0)
    assert f.peak(start + 3 * H, start + 4 * H) == pytest.approx(10.0)
    # An event with an expected rate needs no history
    sale = ScheduledEvent("sale", start, start + H, expected_rps=80.0, lead_s=0)
    assert Forecaster(None, EventCalendar([sale])).peak(start, start + 60) == 80.0


def test_events_come_from_the_fleet_config() -> None:
    spec = ScheduledEventSpec.model_validate(
        {
            "name": "final",
            "start": "2024-01-08T14:00:00+05:30",
            "end": "2024-01-08T18:00:00+05:30",
            "multiplier": 3,
        }
    )
    ev = ScheduledEvent.from_spec(spec)
    assert ev.start == datetime(2024, 1, 8, 8, 30, tzinfo=UTC).timestamp()
    assert ev.end - ev.start == 4 * H and ev.lead_s == 900
    with pytest.raises(ValueError):
        ScheduledEventSpec.model_validate(
            {"name": "x", "start": "2024-01-08T14:00:00", "end": "2024-01-08T15:00:00Z"}
        )
    with pytest.raises(ValueError):
        ScheduledEvent("bad", 10.0, 5.0, multiplier=2)
