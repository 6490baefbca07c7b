"""The shared load store on Redis: one Lua script per sync, keys that expire with their gateway.

Keys (``NS`` is ``TIDAL_REDIS_NAMESPACE``, ``tidal`` by default)::

    NS:gw:<gateway id>   hash   this gateway's load: "t" -> publication time (Redis server ms),
                                "r:<replica>" -> "<in flight> <prompt tokens not yet prefilled>",
                                "q:<pool>" -> requests waiting in its admission queue,
                                "u:<pool> <tenant>" -> requests it admitted for the tenant,
                                "p:<pool>" -> "<requests/s> <errors/s>" over its window;
                                rewritten whole at each sync, PEXPIRE ttl
    NS:gateways          zset   gateway id -> expiry (server ms): the live gateways
    NS:cap:<replica>     hash   "v" -> the replica's cap, "e" -> its epoch (decisions so far);
                                PEXPIRE 24 h from the last decision
    NS:counts            hash   counter name -> the fleet's total (HINCRBY by each gateway's
                                increments); PEXPIRE 24 h from the last increment

One sync is one ``EVALSHA`` (redis-py reloads the script after a Redis restart): it rewrites this
gateway's hash and its index entry, drops index entries past their expiry, applies the cap
proposals (compare-and-set on the epoch; a missing key takes any proposal), adds the gateway's
counter increments, and returns the server time, the accepted proposals, the caps asked about,
every other live gateway's hash and the counters' totals.
Times come from Redis's clock (``TIME``), so gateways on hosts whose clocks differ agree on
ages and expiries. The script touches keys it does not declare, so it needs one Redis server
(with replicas or Sentinel as you like), not Redis Cluster.

A gateway that dies stops counting when its hash expires (``ttl_s``); one that stops cleanly
deletes it (:meth:`RedisLoadStore.leave`).

Example::

    store = RedisLoadStore("redis://127.0.0.1:6379/0", gateway_id="gw-a", ttl_s=2.0)
    reply = await store.sync(GatewayLoad({"r0": (3, 512)}), [], ["r0"])
"""

from __future__ import annotations

import math
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tidal.router.shared import CapProposal, GatewayLoad, SharedCap, StoreUnavailable, SyncReply

__all__ = ["RedisLoadStore", "new_gateway_id"]

CAP_TTL_MS = 24 * 3600 * 1000  # (the counters' too)

_SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local i = 4
local n = tonumber(ARGV[i]); i = i + 1
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 't', now)
for _ = 1, n do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]); i = i + 2
end
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[1], now + ttl, id)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 4)
local accepted = {}
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local key = prefix .. 'cap:' .. ARGV[i]
  local expected = tonumber(ARGV[i + 1])
  local epoch = tonumber(redis.call('HGET', key, 'e') or '-1')
  if epoch == -1 or epoch == expected then
    redis.call('HSET', key, 'v', ARGV[i + 2], 'e', math.max(epoch, expected) + 1)
    redis.call('PEXPIRE', key, tonumber(ARGV[i + 3]))
    table.insert(accepted, ARGV[i])
  end
  i = i + 4
end
local caps = {}
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local v = redis.call('HMGET', prefix .. 'cap:' .. ARGV[i], 'v', 'e')
  table.insert(caps, v[1] or '')
  table.insert(caps, v[2] or '')
  i = i + 1
end
local others = {}
for _, other in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')) do
  if other ~= id then
    local h = redis.call('HGETALL', prefix .. 'gw:' .. other)
    if #h > 0 then
      table.insert(others, other)
      table.insert(others, h)
    end
  end
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1]); i = i + 2
end
if n > 0 then
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[i]))
end
return {now, accepted, caps, others, redis.call('HGETALL', KEYS[3])}
"""


def new_gateway_id() -> str:
    """A name for this gateway process, unique across hosts and restarts: host, pid, random."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(3)}"


def _s(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _load(flat: Sequence[Any], now_ms: int) -> tuple[GatewayLoad, float]:
    replicas: dict[str, tuple[int, int]] = {}
    queued: dict[str, int] = {}
    tenants: dict[tuple[str, str], int] = {}
    rates: dict[str, tuple[float, float]] = {}
    published = now_ms
    for k, v in zip(flat[::2], flat[1::2], strict=True):
        key, value = _s(k), _s(v)
        try:
            if key.startswith("r:"):
                inflight, _, prefill = value.partition(" ")
                replicas[key[2:]] = (int(inflight), int(prefill or 0))
            elif key.startswith("q:"):
                queued[key[2:]] = int(value)
            elif key.startswith("u:"):
                pool, _, tenant = key[2:].partition(" ")
                tenants[(pool, tenant)] = int(value)
            elif key.startswith("p:"):
                rps, _, eps = value.partition(" ")
                r, e = float(rps), float(eps or 0)
                if math.isfinite(r) and math.isfinite(e) and r >= 0 and e >= 0:
                    rates[key[2:]] = (r, e)
            elif key == "t":
                published = int(value)
        except ValueError:
            continue  # a field this version does not read
    return GatewayLoad(replicas, queued, tenants, rates), max(0.0, (now_ms - published) / 1000)


class RedisLoadStore:
    """:class:`~router.shared.LoadStore` on one Redis server (``redis`` from PyPI, asyncio).

    **Parameters:** ``url`` (``redis://host:port/db``); ``gateway_id`` (default
    :func:`new_gateway_id`); ``namespace`` -- the key prefix; ``ttl_s`` -- how long this
    gateway's published counts live; ``timeout_s`` -- connect and read timeout of one sync (no
    retries: the next sync is the retry).
    """

    def __init__(
        self,
        url: str,
        *,
        gateway_id: str | None = None,
        namespace: str = "tidal",
        ttl_s: float = 2.0,
        timeout_s: float = 0.5,
    ) -> None:
        self.gateway_id = gateway_id or new_gateway_id()
        self.prefix = f"{namespace}:"
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            client_name=f"tidal-gateway-{self.gateway_id}"[:100],
        )
        self._script = self._redis.register_script(_SYNC)
        self._keys = [f"{self.prefix}gateways", f"{self.prefix}gw:{self.gateway_id}", f"{self.prefix}counts"]

    async def sync(
        self,
        mine: GatewayLoad,
        proposals: Sequence[CapProposal],
        replicas: Sequence[str],
        increments: Mapping[str, int] | None = None,
    ) -> SyncReply:
        args: list[str | int] = [self.gateway_id, self.ttl_ms, self.prefix]
        args.append(len(mine.replicas) + len(mine.queued) + len(mine.tenants) + len(mine.rates))
        for name, (inflight, prefill) in mine.replicas.items():
            args += [f"r:{name}", f"{inflight} {prefill}"]
        for pool, n in mine.queued.items():
            args += [f"q:{pool}", n]
        for (pool, tenant), n in mine.tenants.items():  # names hold no spaces (fleet Name)
            args += [f"u:{pool} {tenant}", n]
        for pool, (rps, eps) in mine.rates.items():
            args += [f"p:{pool}", f"{rps:.6g} {eps:.6g}"]
        args.append(len(proposals))
        for p in proposals:
            args += [p.replica, p.expected_epoch, p.value, CAP_TTL_MS]
        args.append(len(replicas))
        args += list(replicas)
        increments = increments or {}
        args.append(len(increments))
        for name, n in increments.items():
            args += [name, n]
        args.append(CAP_TTL_MS)
        try:
            now_ms, accepted, caps_flat, others_flat, counts_flat = await self._script(
                keys=self._keys, args=args
            )
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        now_ms = int(now_ms)
        caps: dict[str, SharedCap] = {}
        for name, v, e in zip(replicas, caps_flat[::2], caps_flat[1::2], strict=True):
            if v and e:
                caps[name] = SharedCap(int(v), int(e))
        others: dict[str, GatewayLoad] = {}
        ages: dict[str, float] = {}
        for gid, flat in zip(others_flat[::2], others_flat[1::2], strict=True):
            others[_s(gid)], ages[_s(gid)] = _load(flat, now_ms)
        counts = {_s(k): int(v) for k, v in zip(counts_flat[::2], counts_flat[1::2], strict=True)}
        return SyncReply(others, ages, caps, frozenset(_s(a) for a in accepted), counts)

    async def leave(self) -> None:
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self._keys[1])
                pipe.zrem(self._keys[0], self.gateway_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    async def aclose(self) -> None:
        await self._redis.aclose()
