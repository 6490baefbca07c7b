"""Load history to learn an hour-of-week profile from: what a pool served in earlier weeks.

Three formats, each read into per-minute request rates (:class:`History`):

* ``timestamps`` -- a CSV with one request per row: the first column, or the one named
  ``timestamp``/``time`` (any case; Azure's ``TIMESTAMP,ContextTokens,GeneratedTokens`` is
  one), in Unix seconds or ISO 8601 (no offset: UTC). Requests are counted per minute; a
  minute at either end that the file covers for less than half is left out.
* ``rates`` -- a CSV whose header names a time column (``time``, ``timestamp``, ``minute``)
  and either ``rps`` (also ``requests_per_s``, ``rate``) or ``requests`` (also ``count``:
  requests in the row's interval, the median spacing of the rows).
* ``prometheus`` -- the JSON answer of Prometheus' ``/api/v1/query_range`` (a ``matrix``) of a
  query in requests per second, e.g. ``sum(rate(tidal_gateway_requests_total[1m]))``; several
  series are summed per timestamp.

``auto`` picks by extension and header. Every problem is a :class:`HistoryError` naming the
file and line (or JSON path).

Example::

    history = read_history("requests.csv")          # auto: timestamps or rates
    profile = history.profile()                     # HourOfWeekProfile fitted to it
    history.minutes, history.start, history.end
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from tidal.scheduler.autoscaler.forecast import HourOfWeekProfile

__all__ = ["History", "HistoryError", "HistoryFormat", "read_history"]

HistoryFormat = Literal["auto", "timestamps", "rates", "prometheus"]
_TIME_NAMES = ("timestamp", "time", "minute", "ts", "t")
_RATE_NAMES = ("rps", "requests_per_s", "requests_per_second", "rate")
_COUNT_NAMES = ("requests", "count")
_MAX_JSON_BYTES = 256 * 1024 * 1024
_MAX_SECONDS = 32503680000.0  # year 3000: a larger "Unix time" is milliseconds or garbage
_MINUTE = 60.0


class HistoryError(ValueError):
    """A history file that cannot be read as the format says; the message names the place."""


@dataclass(frozen=True, slots=True)
class History:
    """Request rates over time: ``samples`` of ``(unix_s, requests_per_s)`` in time order."""

    samples: tuple[tuple[float, float], ...]
    source: str

    @property
    def start(self) -> float:
        return self.samples[0][0]

    @property
    def end(self) -> float:
        return self.samples[-1][0]

    @property
    def minutes(self) -> int:
        return len(self.samples)

    def profile(self, **options: Any) -> HourOfWeekProfile:
        """An :class:`HourOfWeekProfile` (``options`` are its parameters) fitted to this history."""
        return HourOfWeekProfile(**options).fit(self.samples)


def read_history(path: str | Path, fmt: HistoryFormat = "auto") -> History:
    """Read ``path`` as ``fmt`` (see the module docstring); raises :class:`HistoryError`."""
    p = Path(path)
    if not p.is_file():
        raise HistoryError(f"{p}: no such file")
    if fmt == "auto":
        fmt = "prometheus" if p.suffix.lower() == ".json" else _csv_kind(p)
    if fmt == "prometheus":
        samples = _read_prometheus(p)
    elif fmt == "rates":
        samples = _read_rates(p)
    elif fmt == "timestamps":
        samples = _read_timestamps(p)
    else:
        raise HistoryError(f"unknown history format {fmt!r} (known: auto, timestamps, rates, prometheus)")
    if not samples:
        raise HistoryError(f"{p}: no history in it (a whole minute of it at least)")
    return History(tuple(samples), f"{p.name} ({fmt})")


# -- parsing helpers ------------------------------------------------------------------------------


def _parse_time(raw: str, where: str) -> float:
    text = raw.strip()
    if not text:
        raise HistoryError(f"{where}: empty time")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    else:
        if not math.isfinite(value) or value < 0:
            raise HistoryError(f"{where}: time {text!r} is not a Unix time")
        if value > _MAX_SECONDS:
            raise HistoryError(f"{where}: time {text!r} is after the year 3000: milliseconds? give seconds")
        return value
    iso = text.replace("Z", "+00:00")
    if "." in iso:  # Python reads at most 6 fractional digits; traces have 7 or 9
        head, frac = iso.split(".", 1)
        digits = len(frac) - len(frac.lstrip("0123456789"))
        iso = f"{head}.{frac[: min(digits, 6)]}{frac[digits:]}"
    try:
        stamp = datetime.fromisoformat(iso)
    except ValueError:
        raise HistoryError(
            f"{where}: time {text!r} is neither Unix seconds nor ISO 8601 (e.g. 2026-03-02T14:00:00Z)"
        ) from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def _parse_number(raw: str, where: str, what: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise HistoryError(f"{where}: {what} {raw.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise HistoryError(f"{where}: {what} must be a finite number >= 0, got {raw.strip()!r}")
    return value


def _rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            for n, row in enumerate(csv.reader(f), 1):
                if row and any(c.strip() for c in row):
                    yield n, row
    except UnicodeDecodeError:
        raise HistoryError(f"{path}: not a text CSV file") from None
    except csv.Error as exc:
        raise HistoryError(f"{path}: not a CSV file ({exc})") from None


def _header(row: list[str]) -> list[str] | None:
    """The row's lower-case names if it is a header (its first cell is not a time)."""
    first = row[0].strip()
    try:
        _parse_time(first, "")
    except HistoryError:
        return [c.strip().lower() for c in row]
    return None


def _find(names: list[str], wanted: tuple[str, ...]) -> int | None:
    return next((names.index(w) for w in wanted if w in names), None)


def _csv_kind(path: Path) -> HistoryFormat:
    for _, row in _rows(path):
        names = _header(row)
        if names is not None and (
            _find(names, _RATE_NAMES) is not None or _find(names, _COUNT_NAMES) is not None
        ):
            return "rates"
        return "timestamps"
    raise HistoryError(f"{path}: empty file")


# -- the formats ----------------------------------------------------------------------------------


def _read_timestamps(path: Path) -> list[tuple[float, float]]:
    counts: dict[int, int] = defaultdict(int)
    first, last = math.inf, -math.inf
    col = 0
    started = False
    for n, row in _rows(path):
        if not started:  # the first row may be a header naming the time column
            started = True
            names = _header(row)
            if names is not None:
                found = _find(names, _TIME_NAMES)
                if found is None and len(names) > 1:
                    raise HistoryError(
                        f"{path}:{n}: no time column (name one {', '.join(_TIME_NAMES[:2])}, or put it first)"
                    )
                col = found or 0
                continue
        if col >= len(row):
            raise HistoryError(f"{path}:{n}: no column {col + 1}")
        t = _parse_time(row[col], f"{path}:{n}")
        counts[math.floor(t / _MINUTE)] += 1
        first, last = min(first, t), max(last, t)
    if not counts:
        raise HistoryError(f"{path}: no request timestamps")
    lo, hi = math.floor(first / _MINUTE), math.floor(last / _MINUTE)
    out = []
    for b in range(lo, hi + 1):
        start, end = b * _MINUTE, (b + 1) * _MINUTE
        covered = min(end, last) - max(start, first)
        if covered < _MINUTE / 2:
            continue  # a minute the file barely covers says nothing about its rate
        out.append((start, counts.get(b, 0) / covered))
    return out


def _read_rates(path: Path) -> list[tuple[float, float]]:
    rows = _rows(path)
    try:
        n, head = next(rows)
    except StopIteration:
        raise HistoryError(f"{path}: empty file") from None
    names = _header(head)
    if names is None:
        raise HistoryError(
            f"{path}:{n}: per-minute rates need a header naming the time column and 'rps' or 'requests'"
        )
    t_col = _find(names, _TIME_NAMES)
    rate_col = _find(names, _RATE_NAMES)
    count_col = _find(names, _COUNT_NAMES)
    if t_col is None:
        raise HistoryError(f"{path}:{n}: no time column (one of {', '.join(_TIME_NAMES)})")
    if rate_col is None and count_col is None:
        raise HistoryError(
            f"{path}:{n}: no rate column ({', '.join(_RATE_NAMES)}) or count column ({', '.join(_COUNT_NAMES)})"
        )
    value_col = rate_col if rate_col is not None else count_col
    assert value_col is not None
    points: list[tuple[float, float]] = []
    for n, row in rows:
        if max(t_col, value_col) >= len(row):
            raise HistoryError(f"{path}:{n}: expected {len(names)} columns, got {len(row)}")
        where = f"{path}:{n}"
        points.append(
            (_parse_time(row[t_col], where), _parse_number(row[value_col], where, names[value_col]))
        )
    points.sort()
    for (a, _), (b, _) in zip(points, points[1:], strict=False):
        if a == b:
            raise HistoryError(f"{path}: two rows for the time {a:g}")
    if rate_col is None:
        if len(points) < 2:
            raise HistoryError(f"{path}: counts need two rows at least (their spacing is the interval)")
        interval = statistics.median(b - a for (a, _), (b, _) in zip(points, points[1:], strict=False))
        points = [(t, c / interval) for t, c in points]
    return points


def _read_prometheus(path: Path) -> list[tuple[float, float]]:
    if path.stat().st_size > _MAX_JSON_BYTES:
        raise HistoryError(f"{path}: larger than {_MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HistoryError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HistoryError(f"{path}: expected the JSON object of /api/v1/query_range")
    if data.get("status") == "error":
        raise HistoryError(
            f"{path}: Prometheus answered an error: {data.get('errorType')}: {data.get('error')}"
        )
    body = data.get("data", data)
    if not isinstance(body, dict) or "result" not in body:
        raise HistoryError(f"{path}: no data.result: not a /api/v1/query_range answer")
    if body.get("resultType") != "matrix":
        raise HistoryError(
            f"{path}: data.resultType is {body.get('resultType')!r}, expected 'matrix' (a range query)"
        )
    result = body["result"]
    if not isinstance(result, list):
        raise HistoryError(f"{path}: data.result must be a list of series")
    total: dict[float, float] = defaultdict(float)
    for i, series in enumerate(result):
        values = series.get("values") if isinstance(series, dict) else None
        if not isinstance(values, list):
            raise HistoryError(f"{path}: data.result[{i}].values must be a list of [time, value]")
        for j, point in enumerate(values):
            where = f"{path}: data.result[{i}].values[{j}]"
            if not (isinstance(point, list) and len(point) == 2):
                raise HistoryError(f'{where}: expected [unix_time, "value"]')
            t, v = point
            if isinstance(t, bool) or not isinstance(t, int | float):
                raise HistoryError(f"{where}: the time must be a number")
            if not isinstance(v, str):
                raise HistoryError(f"{where}: the value must be a string, as Prometheus writes it")
            if v.strip().lower() == "nan":
                continue  # no data at that step (stale series)
            total[float(t)] += _parse_number(v, where, "value")
    return sorted(total.items())
