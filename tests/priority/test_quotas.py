"""Tenant quotas: any 60 s window holds at most the limit, in this process or through Redis for
every gateway, with OpenAI's headers; minutes of traffic run in virtual time."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

import pytest

from tests.services import require_tcp
from tidal.clock import ManualClock
from tidal.fleet import QuotaSpec
from tidal.priority.quotas import LocalQuotas, QuotaStore, QuotaUnavailable, RedisQuotas, format_reset

REDIS = "redis://127.0.0.1:6379/0"

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["local", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        require_tcp("Redis", "127.0.0.1", 6379)
    return str(request.param)


@contextlib.asynccontextmanager
async def quota_stores(kind: str, clock: ManualClock, n: int = 1) -> AsyncIterator[list[QuotaStore]]:
    """One local store, or ``n`` gateways' Redis stores (one namespace per test; its keys expire
    on their own), closed at the end."""
    namespace = f"tidal-test-{secrets.token_hex(4)}"
    stores: list[QuotaStore] = (
        [LocalQuotas(clock)]
        if kind == "local"
        else [RedisQuotas(REDIS, clock, namespace=namespace) for _ in range(n)]
    )
    try:
        yield stores
    finally:
        for s in stores:
            await s.aclose()


async def test_requests_per_minute_count_down_and_refuse_with_the_wait(kind: str) -> None:
    clock = ManualClock(1000.0)
    async with quota_stores(kind, clock) as (store,):
        quota = QuotaSpec(requests_per_minute=5)
        remaining = []
        for _ in range(5):
            v = await store.take("acme", quota, tokens=10)
            assert v.allowed
            remaining.append(dict(v.headers())[b"x-ratelimit-remaining-requests"])
            clock.advance(2.0)
        assert remaining == [b"4", b"3", b"2", b"1", b"0"]
        refused = await store.take("acme", quota, tokens=10)
        assert not refused.allowed and refused.exceeded is not None and refused.exceeded.kind == "requests"
        # The first request (at t=1000) leaves the window at t=1060.5 (all of its half-second
        # bucket more than 60 s old); it is t=1010 now.
        assert refused.retry_after_s == 51
        assert "requests per minute" in refused.message("acme") and "limit 5" in refused.message("acme")
        headers = dict(refused.headers())
        assert headers[b"x-ratelimit-limit-requests"] == b"5"
        assert headers[b"x-ratelimit-reset-requests"] == b"59s"  # the newest (t=1008) leaves at 1068.5
        # Another tenant is not touched, and a tenant without a quota is never counted.
        assert (await store.take("other", quota, tokens=10)).allowed
        assert (await store.take("free", QuotaSpec(), tokens=10**9)).headers() == []
        clock.advance(50.0)
        assert not (await store.take("acme", quota, tokens=10)).allowed
        clock.advance(0.5)
        assert (await store.take("acme", quota, tokens=10)).allowed


async def test_tokens_are_reserved_then_settled_with_the_real_usage(kind: str) -> None:
    clock = ManualClock(50.0)
    async with quota_stores(kind, clock) as (store,):
        quota = QuotaSpec(tokens_per_minute=1000)
        first = await store.take("acme", quota, tokens=700)  # prompt + max_tokens
        assert first.allowed and first.reservation is not None
        refused = await store.take("acme", quota, tokens=400)
        assert not refused.allowed and refused.exceeded is not None and refused.exceeded.kind == "tokens"
        await store.settle(first.reservation, used_tokens=250)  # it used far less than max_tokens
        second = await store.take("acme", quota, tokens=400)
        assert second.allowed
        assert dict(second.headers())[b"x-ratelimit-remaining-tokens"] == b"350"
        # A request that can never fit says so.
        huge = await store.take("acme", quota, tokens=5000)
        assert not huge.allowed and "Request too large" in huge.message("acme") and huge.retry_after_s == 60


async def test_four_gateways_admit_the_limit_over_five_minutes_of_excess_traffic(kind: str) -> None:
    """600 requests per minute offered for 5 minutes through four gateways in turn, limit 120 a
    minute: 600 admitted (within 2%), never more than 120 in any 60 s."""
    clock = ManualClock(7.3)
    async with quota_stores(kind, clock, 4) as stores:
        quota = QuotaSpec(requests_per_minute=120)
        admitted: list[float] = []
        start = clock.now()
        i = 0
        while clock.now() - start < 300.0:
            v = await stores[i % len(stores)].take("acme", quota, tokens=1)
            if v.allowed:
                admitted.append(clock.now() - start)
            i += 1
            clock.advance(0.1)
        assert abs(len(admitted) - 600) <= 12, len(admitted)
        for j, t in enumerate(admitted):
            in_window = sum(1 for u in admitted[j:] if u < t + 60.0)
            assert in_window <= 120, (t, in_window)


def test_resets_are_written_like_openai() -> None:
    assert [format_reset(s) for s in (0.04, 0.5, 1.0, 9.95, 12.2, 60.0, 360.0)] == [
        "0.1s",
        "0.5s",
        "1s",
        "10s",
        "13s",
        "1m0s",
        "6m0s",
    ]


async def test_redis_down_is_reported() -> None:
    clock = ManualClock()
    store = RedisQuotas("redis://127.0.0.1:1/0", clock, timeout_s=0.2)
    with pytest.raises(QuotaUnavailable):
        await asyncio.wait_for(store.take("acme", QuotaSpec(requests_per_minute=1), tokens=1), 5)
    await store.aclose()
