"""The shared load store on a real Redis (127.0.0.1:6379, each test in its own key namespace):
loads published and read in one script, a dead gateway's counts expire, caps change by
compare-and-set, and an unreachable Redis is an error the sync loop can handle."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tests.services import require_tcp
from tidal.replicas.launcher import free_port
from tidal.router.redis_load import RedisLoadStore
from tidal.router.shared import CapProposal, GatewayLoad, SharedCap, StoreUnavailable

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def namespace() -> AsyncIterator[str]:
    require_tcp("Redis", "127.0.0.1", 6379)
    ns = f"tidal-test-{secrets.token_hex(4)}"
    yield ns
    r = aioredis.Redis.from_url(URL)
    keys = [k async for k in r.scan_iter(match=f"{ns}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()


def _store(ns: str, gid: str, ttl_s: float = 2.0) -> RedisLoadStore:
    return RedisLoadStore(URL, gateway_id=gid, namespace=ns, ttl_s=ttl_s)


async def test_a_gateway_reads_what_the_others_published(namespace: str) -> None:
    a, b = _store(namespace, "a"), _store(namespace, "b")
    try:
        mine = GatewayLoad(
            {"r0": (3, 100)}, {"interactive": 2}, {("interactive", "acme"): 3}, {"interactive": (12.5, 0.25)}
        )
        await a.sync(mine, [], ["r0"])
        reply = await b.sync(GatewayLoad(), [], ["r0"])
        assert reply.others == {"a": mine}
        assert 0.0 <= reply.ages_s["a"] < 1.0
        # A republication replaces the whole hash: a replica with nothing left disappears.
        await a.sync(GatewayLoad({"r1": (1, 0)}), [], [])
        reply = await b.sync(GatewayLoad(), [], [])
        assert reply.others["a"] == GatewayLoad({"r1": (1, 0)})
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_gateway_that_dies_leaks_nothing_and_one_that_leaves_is_gone_at_once(namespace: str) -> None:
    dead, leaving, reader = (
        _store(namespace, "dead", 0.3),
        _store(namespace, "leaving"),
        _store(namespace, "r"),
    )
    raw = aioredis.Redis.from_url(URL)
    try:
        await dead.sync(GatewayLoad({"r0": (5, 0)}), [], [])
        await leaving.sync(GatewayLoad({"r1": (2, 0)}), [], [])
        assert set((await reader.sync(GatewayLoad(), [], [])).others) == {"dead", "leaving"}
        await leaving.leave()
        assert set((await reader.sync(GatewayLoad(), [], [])).others) == {"dead"}
        # The dead one never syncs again: past its ttl its counts and its key are gone.
        await asyncio.sleep(0.6)
        assert (await reader.sync(GatewayLoad(), [], [])).others == {}
        assert await raw.exists(f"{namespace}:gw:dead") == 0
        assert await raw.zscore(f"{namespace}:gateways", "dead") is None
    finally:
        for s in (dead, leaving, reader):
            await s.aclose()
        await raw.aclose()


async def test_caps_change_by_compare_and_set_on_their_epoch(namespace: str) -> None:
    a, b = _store(namespace, "a"), _store(namespace, "b")
    try:
        # No cap yet: a's proposal, from whatever epoch it had, is taken.
        reply = await a.sync(GatewayLoad(), [CapProposal("r0", 0, 6)], ["r0", "r1"])
        assert reply.accepted == {"r0"} and reply.caps == {"r0": SharedCap(6, 1)}
        # b decided from epoch 0 too: too late, it reads a's.
        reply = await b.sync(GatewayLoad(), [CapProposal("r0", 0, 5)], ["r0"])
        assert reply.accepted == frozenset() and reply.caps["r0"] == SharedCap(6, 1)
        reply = await b.sync(GatewayLoad(), [CapProposal("r0", 1, 7)], ["r0"])
        assert reply.accepted == {"r0"} and reply.caps["r0"] == SharedCap(7, 2)
    finally:
        await a.aclose()
        await b.aclose()


async def test_the_script_is_loaded_again_after_redis_forgot_it(namespace: str) -> None:
    a = _store(namespace, "a")
    raw = aioredis.Redis.from_url(URL)
    try:
        await a.sync(GatewayLoad({"r0": (1, 0)}), [], [])
        await raw.script_flush()  # what a restart does to the script cache
        reply = await a.sync(GatewayLoad({"r0": (1, 0)}), [], [])
        assert reply.others == {}
    finally:
        await a.aclose()
        await raw.aclose()


async def test_an_unreachable_redis_fails_fast_with_store_unavailable() -> None:
    store = RedisLoadStore(f"redis://127.0.0.1:{free_port()}/0", gateway_id="x", timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.sync(GatewayLoad(), [], [])
        assert time.monotonic() - t0 < 2.0
    finally:
        await store.aclose()


async def test_counter_increments_add_up_in_redis_and_come_back_as_totals(namespace: str) -> None:
    a, b = _store(namespace, "a"), _store(namespace, "b")
    try:
        reply = await a.sync(GatewayLoad(), [], [], {"group:canary:requests": 5, "group:canary:errors": 1})
        assert reply.counts == {"group:canary:requests": 5, "group:canary:errors": 1}
        reply = await b.sync(GatewayLoad(), [], [], {"group:canary:requests": 7})
        assert reply.counts == {"group:canary:requests": 12, "group:canary:errors": 1}
        assert (await a.sync(GatewayLoad(), [], [])).counts == reply.counts  # (reading adds nothing)
    finally:
        await a.aclose()
        await b.aclose()
