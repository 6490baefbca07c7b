"""Tenant quotas: requests and tokens per minute, held across every gateway.

A tenant's ``quota`` in the fleet config (``requests_per_minute``, ``tokens_per_minute``) bounds
what it may start in **any 60-second window**: each limit counts in half-second buckets, a
bucket leaves the window once all of it is more than 60 s old (so the window is strict, and a
tenant gets at least 60/60.5 of its limit), and a request is admitted when, with it, the window
stays within every limit of its tenant
(both limits are checked and counted together, so a refused request counts against neither).
Over five minutes of excess traffic a tenant gets five minutes' worth, not six: a window that
slides, unlike one reset on the minute, never lets a burst at its end meet a burst at the next
one's start. Tokens count the prompt plus ``max_tokens`` when the request is admitted (what it
may cost), then :meth:`QuotaStore.settle` replaces that with what it did cost when the answer
ends, in the bucket it was counted in.

Every answer carries OpenAI's headers for the limits its tenant has
(``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
``x-ratelimit-reset-requests`` and the ``-tokens`` triple; the reset is the time until the
window holds nothing of the tenant's again, written like OpenAI's ``1s`` or ``6m0s``), and a
refusal says which limit it hit, with ``Retry-After`` the seconds until the window has room.

Two stores, one decision: :class:`LocalQuotas` keeps the buckets in this process (one gateway,
the embedded default), :class:`RedisQuotas` in Redis, where one Lua script checks and counts
atomically for every gateway (the shared state the scale-out gateways already use). Time comes
from the injected clock, so tests run minutes of traffic in virtual time.

Example::

    quotas = LocalQuotas(clock)
    verdict = await quotas.take("acme", fleet.tenant("acme").quota, tokens=1200)
    if not verdict.allowed: ...              # 429 with verdict.headers() and verdict.retry_after_s
    ...; await quotas.settle(verdict.reservation, used_tokens=830)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tidal.clock import Clock
from tidal.fleet import QuotaSpec

__all__ = [
    "WINDOW_S",
    "LimitState",
    "LocalQuotas",
    "QuotaStore",
    "QuotaUnavailable",
    "QuotaVerdict",
    "RedisQuotas",
    "Reservation",
    "format_reset",
]

WINDOW_S = 60
BUCKET_S = 0.5
_KEPT = round(WINDOW_S / BUCKET_S)  # buckets older than the current one that stay in the window


class QuotaUnavailable(Exception):
    """The shared store did not answer."""


@dataclass(frozen=True, slots=True)
class LimitState:
    """One limit after a decision: its value, what is left of it in the window, seconds until
    the window holds nothing of the tenant's, and the seconds until a request of this cost fits
    (0 when it did)."""

    kind: str  # "requests" or "tokens"
    limit: int
    remaining: int
    reset_s: float
    wait_s: float


@dataclass(frozen=True, slots=True)
class Reservation:
    """What an admitted request counted: its tokens, in bucket ``bucket``."""

    tenant: str
    bucket: int
    tokens: int


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    allowed: bool
    limits: tuple[LimitState, ...] = ()
    exceeded: LimitState | None = None  # the limit that refused it (the longest wait)
    reservation: Reservation | None = None

    @property
    def retry_after_s(self) -> int:
        if self.exceeded is None:
            return 0
        wait = self.exceeded.wait_s
        return WINDOW_S if math.isinf(wait) else max(1, math.ceil(wait))

    def headers(self) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        for s in self.limits:
            out += [
                (f"x-ratelimit-limit-{s.kind}".encode(), str(s.limit).encode()),
                (f"x-ratelimit-remaining-{s.kind}".encode(), str(s.remaining).encode()),
                (f"x-ratelimit-reset-{s.kind}".encode(), format_reset(s.reset_s).encode()),
            ]
        return out

    def message(self, tenant: str) -> str:
        s = self.exceeded
        if s is None:
            return ""
        per = "requests per minute" if s.kind == "requests" else "tokens per minute"
        if math.isinf(s.wait_s):
            return (
                f"Request too large for tenant '{tenant}': it may need more tokens than its limit of "
                f"{s.limit} {per}. Lower max_tokens or the prompt's size."
            )
        return (
            f"Rate limit reached for tenant '{tenant}' on {per}: limit {s.limit}, "
            f"remaining {s.remaining}. Try again in {format_reset(s.wait_s)}."
        )


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes its reset headers: ``0.5s``, ``12s``, ``6m0s``."""
    if seconds < 10:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _limits(quota: QuotaSpec, tokens: int) -> list[tuple[str, int, int]]:
    """``(kind, limit, cost)`` for each limit the quota sets."""
    out = []
    if quota.requests_per_minute is not None:
        out.append(("requests", quota.requests_per_minute, 1))
    if quota.tokens_per_minute is not None:
        out.append(("tokens", quota.tokens_per_minute, max(0, tokens)))
    return out


def _leaves_at(bucket: int) -> float:
    """When a bucket's every request is more than 60 s old."""
    return (bucket + _KEPT + 1) * BUCKET_S


def _state(
    kind: str, limit: int, cost: int, buckets: Mapping[int, int], now: float, counted: bool
) -> LimitState:
    """The limit's state from the window's buckets (bucket -> count, all inside the window)."""
    used = sum(buckets.values())
    newest = max((b for b, n in buckets.items() if n > 0), default=None)
    reset = max(0.0, _leaves_at(newest) - now) if newest is not None else 0.0
    wait = 0.0
    if not counted:
        if cost > limit:
            wait = math.inf
        else:
            # Oldest buckets leave first: wait until enough has left for this cost to fit.
            excess = used + cost - limit
            for b in sorted(buckets) if excess > 0 else ():
                excess -= buckets[b]
                if excess <= 0:
                    wait = max(0.0, _leaves_at(b) - now)
                    break
    return LimitState(kind, limit, max(0, limit - used), reset, wait)


def _bucket(now: float) -> int:
    return math.floor(now / BUCKET_S)


def _decide(
    tenant: str, now: float, checks: list[tuple[str, int, int]], windows: list[dict[int, int]], counted: bool
) -> QuotaVerdict:
    states = tuple(
        _state(k, lim, cost, w, now, counted) for (k, lim, cost), w in zip(checks, windows, strict=True)
    )
    if counted:
        tokens = next((cost for k, _, cost in checks if k == "tokens"), 0)
        return QuotaVerdict(True, states, reservation=Reservation(tenant, _bucket(now), tokens))
    refused = [s for s in states if s.wait_s > 0]
    return QuotaVerdict(False, states, max(refused, key=lambda s: s.wait_s) if refused else None)


class QuotaStore(Protocol):
    async def take(self, tenant: str, quota: QuotaSpec, tokens: int) -> QuotaVerdict:
        """Admit one request of ``tokens`` against every limit of ``quota``, counting it, or refuse."""
        ...

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """The request counted ``reservation.tokens`` and used ``used_tokens``: correct the count."""
        ...

    async def aclose(self) -> None: ...


class LocalQuotas:
    """Quotas counted in this process (one gateway)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._buckets: dict[tuple[str, str], dict[int, int]] = {}

    def _window(self, tenant: str, kind: str, now: float) -> dict[int, int]:
        buckets = self._buckets.setdefault((tenant, kind), {})
        oldest = _bucket(now) - _KEPT
        for b in [b for b in buckets if b < oldest]:
            del buckets[b]
        return buckets

    async def take(self, tenant: str, quota: QuotaSpec, tokens: int) -> QuotaVerdict:
        checks = _limits(quota, tokens)
        if not checks:
            return QuotaVerdict(True)
        now = self.clock.now()
        windows = [self._window(tenant, kind, now) for kind, _, _ in checks]
        fits = all(
            sum(w.values()) + cost <= limit for (_, limit, cost), w in zip(checks, windows, strict=True)
        )
        if fits:
            b = _bucket(now)
            for (_, _, cost), w in zip(checks, windows, strict=True):
                w[b] = w.get(b, 0) + cost
        return _decide(tenant, now, checks, windows, fits)

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        buckets = self._buckets.get((reservation.tenant, "tokens"))
        if buckets is not None and reservation.bucket in buckets:
            buckets[reservation.bucket] = max(
                0, buckets[reservation.bucket] + used_tokens - reservation.tokens
            )

    async def aclose(self) -> None:
        return None


# KEYS: one hash per limit (bucket -> count). ARGV: the current bucket, the older buckets kept,
# then per key its limit and cost.
# Drops the buckets that left the window, admits when every limit fits, counts, and returns the
# decision and each window's buckets (flattened) for the headers.
_TAKE = """
local sec = tonumber(ARGV[1])
local oldest = sec - tonumber(ARGV[2])
local windows, fits = {}, 1
for i, key in ipairs(KEYS) do
  local flat = redis.call('HGETALL', key)
  local used, kept = 0, {}
  for j = 1, #flat, 2 do
    local s, n = tonumber(flat[j]), tonumber(flat[j + 1])
    if s < oldest then
      redis.call('HDEL', key, flat[j])
    else
      used = used + n
      table.insert(kept, flat[j]); table.insert(kept, flat[j + 1])
    end
  end
  if used + tonumber(ARGV[2 + 2 * i]) > tonumber(ARGV[1 + 2 * i]) then fits = 0 end
  windows[i] = kept
end
if fits == 1 then
  for i, key in ipairs(KEYS) do
    local cost = tonumber(ARGV[2 + 2 * i])
    redis.call('HINCRBY', key, sec, cost)
    table.insert(windows[i], tostring(sec)); table.insert(windows[i], tostring(cost))
    redis.call('EXPIRE', key, 2 * 60 + 1)
  end
end
return {fits, windows}
"""

_SETTLE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  local n = redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
  if n < 0 then redis.call('HSET', KEYS[1], ARGV[1], 0) end
end
return 0
"""


def _s(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class RedisQuotas:
    """Quotas counted in Redis, shared by every gateway (``TIDAL_REDIS_URL``; ``namespace`` the
    key prefix). The clock gives the window's time and must be one every gateway shares: wall
    time (:class:`~tidal.clock.WallClock`, which NTP keeps within well under a second across
    hosts), never a process's monotonic clock."""

    def __init__(self, url: str, clock: Clock, *, namespace: str = "tidal", timeout_s: float = 0.5) -> None:
        self.clock = clock
        self.prefix = f"{namespace}:quota:"
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self._take = self._redis.register_script(_TAKE)
        self._settle = self._redis.register_script(_SETTLE)

    def _key(self, tenant: str, kind: str) -> str:
        return f"{self.prefix}{tenant}:{kind}"

    async def take(self, tenant: str, quota: QuotaSpec, tokens: int) -> QuotaVerdict:
        checks = _limits(quota, tokens)
        if not checks:
            return QuotaVerdict(True)
        now = self.clock.now()
        args: list[Any] = [_bucket(now), _KEPT]
        for _, limit, cost in checks:
            args += [limit, cost]
        try:
            fits, flat_windows = await self._take(
                keys=[self._key(tenant, k) for k, _, _ in checks], args=args
            )
        except (RedisError, OSError) as exc:
            raise QuotaUnavailable(f"redis: {exc}") from exc
        windows: list[dict[int, int]] = []
        for flat in flat_windows:
            w: dict[int, int] = {}
            for b, n in zip(flat[::2], flat[1::2], strict=True):
                w[int(_s(b))] = w.get(int(_s(b)), 0) + int(_s(n))
            windows.append(w)
        return _decide(tenant, now, checks, windows, bool(int(fits)))

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        delta = used_tokens - reservation.tokens
        if delta == 0:
            return
        try:
            await self._settle(
                keys=[self._key(reservation.tenant, "tokens")], args=[reservation.bucket, delta]
            )
        except (RedisError, OSError) as exc:
            raise QuotaUnavailable(f"redis: {exc}") from exc

    async def aclose(self) -> None:
        await self._redis.aclose()
