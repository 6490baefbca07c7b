"""Load history in each format becomes per-minute rates and an hour-of-week profile; malformed
files are refused with the file, the line and what is wrong."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tidal.scheduler.autoscaler.forecast import hour_of_week
from tidal.scheduler.autoscaler.history import HistoryError, read_history

MONDAY = datetime(2026, 3, 2, tzinfo=UTC).timestamp()  # 00:00 UTC


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_request_timestamps_are_counted_per_minute(tmp_path: Path) -> None:
    # Given 3 minutes of requests: 60, 120 and 30 in each, as Unix seconds with a header
    times = [MONDAY + i for i in range(60)]
    times += [MONDAY + 60 + i / 2 for i in range(120)]
    times += [MONDAY + 120 + 2 * i for i in range(30)]
    path = write(tmp_path, "req.csv", "timestamp,tokens\n" + "".join(f"{t},5\n" for t in times))
    h = read_history(path)
    # Then: 1, 2 and ~0.5 requests/s, the last minute counted over the part the file covers
    assert h.source == "req.csv (timestamps)"
    assert [t for t, _ in h.samples] == [MONDAY, MONDAY + 60, MONDAY + 120]
    assert [round(r, 2) for _, r in h.samples] == [1.0, 2.0, pytest.approx(30 / 58, abs=0.01)]


def test_iso_timestamps_without_a_header_and_with_seven_fractional_digits(tmp_path: Path) -> None:
    # Azure's trace format: naive times are UTC
    rows = [f"2026-03-02 10:{m:02d}:{s:02d}.1234567" for m in range(3) for s in range(0, 60, 2)]
    h = read_history(write(tmp_path, "azure.csv", "\n".join(rows) + "\n"))
    assert h.minutes == 3 and [round(r, 2) for _, r in h.samples[:2]] == [0.5, 0.5]
    assert h.start == MONDAY + 10 * 3600


def test_per_minute_rates_and_counts(tmp_path: Path) -> None:
    rates = write(tmp_path, "r.csv", "time,rps\n" + "".join(f"{MONDAY + 60 * i},{i}\n" for i in range(5)))
    assert [r for _, r in read_history(rates).samples] == [0, 1, 2, 3, 4]
    # Counts per 5-minute row are rates over the rows' spacing; ISO times; rows in any order
    rows = [f"2026-03-02T00:{5 * i:02d}:00Z,{300 * i}" for i in (2, 0, 1)]
    counts = write(tmp_path, "c.csv", "minute,requests\n" + "\n".join(rows))
    h = read_history(counts)
    assert h.source == "c.csv (rates)" and [r for _, r in h.samples] == [0.0, 1.0, 2.0]


def prom(series: list[list[list[Any]]], **top: Any) -> str:
    body = {
        "resultType": "matrix",
        "result": [{"metric": {"pool": f"p{i}"}, "values": v} for i, v in enumerate(series)],
    }
    return json.dumps({"status": "success", "data": body, **top})


def test_a_prometheus_range_export_sums_its_series(tmp_path: Path) -> None:
    a = [[MONDAY + 60 * i, f"{i}.5"] for i in range(4)]
    b = [[MONDAY + 60 * i, "1"] for i in range(1, 4)] + [[MONDAY + 240, "NaN"]]
    h = read_history(write(tmp_path, "q.json", prom([a, b])))
    assert h.samples == ((MONDAY, 0.5), (MONDAY + 60, 2.5), (MONDAY + 120, 3.5), (MONDAY + 180, 4.5))


def test_a_profile_learns_each_hour_of_the_week_from_history(tmp_path: Path) -> None:
    # Two hours of per-minute rates: 10 rps on Monday 09:00, 40 rps on Monday 18:00
    rows = [(MONDAY + 9 * 3600 + 60 * m, 10.0) for m in range(60)] + [
        (MONDAY + 18 * 3600 + 60 * m, 40.0) for m in range(60)
    ]
    path = write(tmp_path, "r.csv", "time,rps\n" + "".join(f"{t},{r}\n" for t, r in rows))
    profile = read_history(path).profile()
    assert profile.trained_hours == 2
    assert profile.predict(MONDAY + 9.5 * 3600) == 10.0 and profile.predict(MONDAY + 18.2 * 3600) == 40.0
    assert profile.predict(MONDAY + 12 * 3600) is None
    assert hour_of_week(MONDAY + 18 * 3600) == 18


@pytest.mark.parametrize(
    ("name", "text", "fmt", "message"),
    [
        ("e.csv", "", "auto", "empty file"),
        ("t.csv", "timestamp\n1772409600\nyesterday\n", "auto", "t.csv:3: time 'yesterday' is neither Unix seconds nor ISO 8601"),
        ("t.csv", "timestamp\n1772409600000\n", "timestamps", "t.csv:2: time '1772409600000' is after the year 3000: milliseconds?"),
        ("t.csv", "timestamp\n-5\n", "timestamps", "t.csv:2: time '-5' is not a Unix time"),
        ("t.csv", "when,what\n1772409600,x\n", "timestamps", "t.csv:1: no time column"),
        ("t.csv", "1772409600\n1772409610\n", "timestamps", "no history in it"),
        ("r.csv", "1772409600,3\n", "rates", "r.csv:1: per-minute rates need a header"),
        ("r.csv", "time,tokens\n1772409600,3\n", "rates", "r.csv:1: no rate column"),
        ("r.csv", "time,rps\n1772409600,-3\n", "rates", "r.csv:2: rps must be a finite number >= 0, got '-3'"),
        ("r.csv", "time,rps\n1772409600,lots\n", "rates", "r.csv:2: rps 'lots' is not a number"),
        ("r.csv", "time,rps\n1772409600\n", "rates", "r.csv:2: expected 2 columns, got 1"),
        ("r.csv", "time,rps\n1772409600,1\n1772409600,2\n", "rates", "two rows for the time"),
        ("r.csv", "time,requests\n1772409600,60\n", "rates", "counts need two rows at least"),
        ("q.json", "{oops", "auto", "q.json: not JSON"),
        ("q.json", json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"}), "auto",
         "Prometheus answered an error: bad_data: parse error"),
        ("q.json", json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}), "auto",
         "data.resultType is 'vector', expected 'matrix' (a range query)"),
        ("q.json", json.dumps({"status": "success"}), "auto", "no data.result"),
        ("q.json", prom([[[1772409600, 3]]]), "auto", "data.result[0].values[0]: the value must be a string"),
        ("q.json", prom([[[1772409600, "-1"]]]), "auto", "data.result[0].values[0]: value must be a finite number >= 0"),
        ("q.json", prom([[["soon", "1"]]]), "auto", "the time must be a number"),
        ("q.json", prom([[[1772409600]]]), "auto", 'expected [unix_time, "value"]'),
        ("q.json", prom([]), "auto", "no history in it"),
    ],
)  # fmt: skip
def test_malformed_history_is_refused_naming_the_place(
    tmp_path: Path, name: str, text: str, fmt: Any, message: str
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(HistoryError) as exc:
        read_history(path, fmt)
    assert message in str(exc.value), str(exc.value)


def test_a_missing_file_or_format_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="no such file"):
        read_history(tmp_path / "nope.csv")
    path = write(tmp_path, "x.csv", "time,rps\n")
    with pytest.raises(HistoryError, match="unknown history format 'parquet'"):
        read_history(path, "parquet")  # type: ignore[arg-type]
