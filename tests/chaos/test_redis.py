"""Redis lost under traffic: the state several gateways share (in-flight counts, admin changes)
goes with it, and comes back empty.

Real processes: the suite's two simulated replicas, three ``tidal gateway`` processes sharing
state through a Redis of this test's own (its own port and directory, never the machine's), and
three closed-loop streaming clients per gateway on the ``openai`` SDK. Redis is SIGKILLed, stays
down past the shared counts' ttl (each gateway then routes on its own counts), and is started
again on the same port, empty.

Targets: no request fails (no 5xx, no dropped stream), none hangs, none is cut or answered
twice; every gateway says Redis is gone (``tidal_gateway_shared_state_up`` 0) while it is, and
the recovery time is from Redis's restart until every gateway has rejoined (up again, and
seeing all three gateways: ``tidal_gateway_shared_state_gateways``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.api.harness import DEV_KEY, Gateway, fleet_dict, run_gateway
from tests.chaos.matrix import Row, StreamingClients, record
from tests.chaos.services import private_redis
from tidal.replicas.launcher import ReplicaProcess

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

GATEWAYS = 3
TTL_S = 2.0  # shared counts older than this are never used
OUTAGE_S = TTL_S + 1.5  # Redis stays down past the ttl: every gateway on its own counts
RUN_BEFORE_S = 3.0
RUN_AFTER_S = 4.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _all(gws: list[Gateway], name: str, value: float) -> bool:
    try:
        return all(g.metric(name) == value for g in gws)
    except httpx.HTTPError:
        return False


def _retries(gws: list[Gateway]) -> int:
    return sum(int(g.metric("tidal_gateway_retries_total")) for g in gws)


async def _until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not await asyncio.to_thread(cond):
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout:g} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_redis_killed_under_traffic_and_restarted(tmp_path: Path, sims: list[ReplicaProcess]) -> None:
    fleet = fleet_dict([s.url for s in sims])
    fleet["gateway"]["shared_state_interval_s"] = 0.05
    fleet["gateway"]["shared_state_ttl_s"] = TTL_S
    with private_redis(tmp_path) as redis, contextlib.ExitStack() as stack:
        env = {"TIDAL_REDIS_URL": redis.url, "TIDAL_REDIS_NAMESPACE": "tidal-chaos"}
        gws = [stack.enter_context(run_gateway(tmp_path, fleet, env=env)) for _ in range(GATEWAYS)]
        await _until(
            lambda: _all(gws, "tidal_gateway_shared_state_gateways", GATEWAYS), 15, "the gateways to meet"
        )
        clients = [StreamingClients(g.url, DEV_KEY, workers=3, max_tokens=64, timeout_s=20.0) for g in gws]
        retries0 = await asyncio.to_thread(_retries, gws)
        for c in clients:
            c.start()
        try:
            await asyncio.sleep(RUN_BEFORE_S)
            # When Redis is killed under traffic,
            killed_at = time.monotonic()
            await asyncio.to_thread(redis.kill)
            # every gateway says so (and keeps serving),
            noticed = await _until(
                lambda: _all(gws, "tidal_gateway_shared_state_up", 0), 10, "the gateways to notice"
            )
            await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed_at)))
            # and when it is back on the same port, empty, every gateway rejoins.
            await asyncio.to_thread(redis.start)
            restarted_at = time.monotonic()
            outage = restarted_at - killed_at

            def rejoined() -> bool:
                return _all(gws, "tidal_gateway_shared_state_up", 1) and _all(
                    gws, "tidal_gateway_shared_state_gateways", GATEWAYS
                )

            recovery_s = await _until(rejoined, 15, "every gateway to rejoin")
            await asyncio.sleep(RUN_AFTER_S)
        finally:
            for c in clients:
                await c.stop()
        retried = await asyncio.to_thread(_retries, gws) - retries0
    outcomes = [o for c in clients for o in c.outcomes]

    def count(kind: str) -> int:
        return sum(c.count(kind) for c in clients)

    row = record(
        Row(
            tier="interactive",
            fault="Redis SIGKILL under traffic, restarted empty",
            requests=len(outcomes),
            failed=count("failed"),
            retried=retried,
            lost=count("lost"),
            duplicated=count("duplicated"),
            hung=count("hung"),
            recovery_s=recovery_s,
            note=(
                f"{GATEWAYS} gateways sharing state; Redis down {outage:.1f} s (ttl {TTL_S:g} s), "
                f"every gateway reported it down after {noticed:.2f} s; recovery from Redis's "
                "restart until every gateway rejoined"
            ),
        )
    )
    summaries = [c.summary() for c in clients]
    assert row.failed == row.hung == row.lost == row.duplicated == 0, summaries
    during = [o for o in outcomes if killed_at <= o.start < restarted_at]
    assert during and all(o.kind == "ok" for o in during), summaries  # served while it was down
