"""Network faults between the gateway and one replica, injected by a userspace TCP proxy
(:mod:`tests.chaos.netproxy`: this kernel has no ``netem``) placed in that replica's stead in the
gateway's fleet. Real processes: two simulated replicas, ``tidal gateway``, and eight
closed-loop streaming clients on the ``openai`` SDK.

* Latency and packet loss on one replica: 150 ms each way on every chunk and 5% of the chunks
  held for a retransmission timeout (200-400 ms). No request fails or hangs, the gateway sends
  the degraded replica a smaller share of the traffic, and once the link is clean the clients'
  time to first token is back near its baseline.
* A replica's KV-event stream cut (its PUB and replay connections reset, and every new one, for
  4 s) under traffic, then restored. No request fails; while cut, the gateway's replay questions
  go unanswered, the replica's index ages past its 2 s bound and decisions stop using it; after
  the restore the gateway sees the loss (a gap, or a publisher it cannot tell from a restarted
  one), rebuilds or replays, and its index holds exactly what a subscriber that was never cut
  holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.api.harness import DEV_KEY, Gateway, fleet_dict, run_gateway
from tests.chaos.conftest import running_sims
from tests.chaos.matrix import Outcome, Row, StreamingClients, record
from tests.chaos.netproxy import FaultProxy
from tidal.clock import SystemClock
from tidal.replicas.wire.kv_events import KVEventSubscriber
from tidal.router.kv_events import ReplicaBlockIndex

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIME_SCALE = 0.04  # a fast-test step of 1 ms lasts 25 ms: a 64-token stream about 1.7 s
DELAY_S = 0.15  # each way, on every chunk
LOSS = 0.05  # of the chunks, held for a retransmission timeout
RTO_S = (0.2, 0.4)
BASELINE_S = 4.0
DEGRADED_S = 8.0
CLEAN_S = 6.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _p95(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else values[0]


def _decisions(gw: Gateway) -> dict[str, float]:
    """Routing decisions per replica, and per session-ring result (``hit``: the session's home)."""
    out = {r: gw.metric("tidal_router_decisions_total", replica=r) for r in ("replica-0", "replica-1")}
    for result in ("hit", "walked", "followed", "miss"):
        out[result] = gw.metric("tidal_router_session_total", result=result)
    return out


def _share(before: dict[str, float], after: dict[str, float]) -> float:
    """The degraded replica's (replica-0's) share of the decisions between two readings."""
    d = {r: after[r] - before[r] for r in ("replica-0", "replica-1")}
    total = sum(d.values())
    return d["replica-0"] / total if total else float("nan")


def _off_home(before: dict[str, float], after: dict[str, float]) -> float:
    """The share of decisions that placed a session off its home replica on the ring."""
    d = {r: after[r] - before[r] for r in ("hit", "walked", "followed", "miss")}
    total = sum(d.values())
    return 1 - d["hit"] / total if total else float("nan")


def _ttfts(outcomes: list[Outcome], start: float, end: float) -> list[float]:
    return [o.ttft for o in outcomes if start <= o.start < end and o.ttft is not None]


def _recovered_at(outcomes: list[Outcome], clean_at: float, bound: float) -> float | None:
    """The first start after ``clean_at`` from which every request's TTFT is within ``bound``."""
    after = sorted((o for o in outcomes if o.start >= clean_at), key=lambda o: o.start)
    for i, o in enumerate(after):
        if all(x.kind == "ok" and x.ttft is not None and x.ttft <= bound for x in after[i:]):
            return o.start
    return None


async def test_latency_and_packet_loss_on_one_replica(tmp_path: Path) -> None:
    with (
        running_sims(tmp_path, 2, TIME_SCALE) as sims,
        FaultProxy(sims[0].port, seed=14) as proxy,
        run_gateway(tmp_path, fleet_dict([proxy.url, sims[1].url])) as gw,
    ):
        clients = StreamingClients(gw.url, DEV_KEY, workers=8, max_tokens=64, timeout_s=20.0)
        clients.start()
        t_start = time.monotonic()
        await asyncio.sleep(BASELINE_S)
        base_decisions = await asyncio.to_thread(_decisions, gw)
        degraded_at = time.monotonic()
        proxy.degrade(delay_s=DELAY_S, loss=LOSS, rto_s=RTO_S)
        await asyncio.sleep(DEGRADED_S)
        degraded_decisions = await asyncio.to_thread(_decisions, gw)
        clean_at = time.monotonic()
        proxy.clean()
        await asyncio.sleep(CLEAN_S)
        await clients.stop()
        stalled = proxy.stats.stalled
    outcomes = clients.outcomes
    # The first second warms the gateway and the replicas up: the baseline starts after it.
    baseline = _ttfts(outcomes, t_start + 1.0, degraded_at)
    degraded = _ttfts(outcomes, degraded_at, clean_at)
    base_p95 = _p95(baseline)
    # "Near baseline": closer to the baseline than to the added round trip (2 x DELAY_S).
    bound = base_p95 + DELAY_S
    recovered = _recovered_at(outcomes, clean_at, bound)
    recovery_s = recovered - clean_at if recovered is not None else None
    zero = dict.fromkeys(base_decisions, 0.0)
    share_before = _share(zero, base_decisions)
    off_before, off_during = _off_home(zero, base_decisions), _off_home(base_decisions, degraded_decisions)
    share_during = _share(base_decisions, degraded_decisions)
    slowest = max(o.end - o.start for o in outcomes)
    note = (
        f"{DELAY_S * 1000:.0f} ms each way, {LOSS:.0%} of chunks stalled "
        f"{RTO_S[0] * 1000:.0f}-{RTO_S[1] * 1000:.0f} ms ({stalled} stalls); degraded replica's share "
        f"{share_before:.2f} -> {share_during:.2f}, sessions placed off their home {off_before:.0%} -> "
        f"{off_during:.0%}; TTFT p95 {base_p95 * 1000:.0f} ms -> "
        f"{_p95(degraded) * 1000:.0f} ms; slowest request {slowest:.1f} s of its {clients.timeout_s:g} s; "
        "recovery from the link made clean to TTFT back within baseline p95 + "
        f"{DELAY_S * 1000:.0f} ms"
    )
    row = record(clients.row("interactive", "latency + packet loss on one replica", recovery_s, note))
    # No request failed, hung, was cut or answered twice: a slow replica is slow, not broken.
    assert row.failed == row.hung == row.lost == row.duplicated == 0, clients.summary()
    # The fault was real: requests through the proxy got the added round trip (each one's request
    # and first token both went through the delay) and the stalls.
    through_proxy = sum(1 for t in degraded if t >= 2 * DELAY_S)
    assert stalled > 0 and through_proxy >= 3, note
    # The gateway moved load off the degraded replica (it holds its requests longer).
    assert share_during < share_before, note
    # And once the link is clean, TTFT is back near its baseline.
    assert recovery_s is not None and recovery_s < CLEAN_S - 2.0, note


# -- a replica's KV-event stream cut ------------------------------------------------------------

CUT_S = 4.0  # longer than the exact index's staleness bound (the kv-index's max_staleness_s, 2 s)
BOUND_S = 2.0


def _kv(gw: Gateway, name: str) -> dict[str, Any]:
    rows = {r["name"]: r for r in gw.admin("GET", "/admin/replicas").json()["data"]}
    kv = rows[name]["kv_events"]
    assert kv is not None, rows[name]
    return dict(kv)


def _port(address: str | None) -> int:
    assert address is not None
    return int(address.rsplit(":", 1)[1])


def _index_sources(gw: Gateway) -> dict[str, float]:
    return {s: gw.metric("tidal_router_kv_index_total", source=s) for s in ("exact", "mixed", "estimate")}


async def _until(cond: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Seconds until ``cond()`` held (polled every 20 ms); fails after ``timeout``."""
    t0 = time.monotonic()
    while not await cond():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout:g} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_a_replicas_kv_event_stream_cut_and_restored(tmp_path: Path) -> None:
    with running_sims(tmp_path, 2, TIME_SCALE, kv_events=True) as sims:
        pub, replay = sims[0].kv_events_addresses()
        with (
            FaultProxy(_port(pub)) as pub_proxy,
            FaultProxy(_port(replay)) as replay_proxy,
        ):
            fleet = fleet_dict([s.url for s in sims])
            fleet["models"][0]["tokenizer"] = "sim"  # the gateway keys prompts as the replicas do
            replicas = fleet["pools"]["interactive"]["replicas"]
            # replica-0's events reach the gateway through the proxies; replica-1's directly.
            replicas[0]["kv_events"] = {
                "endpoint": pub_proxy.address(),
                "replay_endpoint": replay_proxy.address(),
                "topic": "",
            }
            replicas[1]["kv_events"] = sims[1].kv_events_spec()
            # The truth: the same stream followed straight from the replica, never cut.
            truth = ReplicaBlockIndex()
            truth_sub = KVEventSubscriber(
                pub, truth, replay_endpoint=replay, clock=SystemClock(), probe_interval_s=0.25
            )
            truth_task = asyncio.create_task(truth_sub.run())
            try:
                with run_gateway(tmp_path, fleet) as gw:
                    row, note = await _cut_and_restore(gw, pub_proxy, replay_proxy, truth, truth_sub)
            finally:
                truth_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await truth_task
    assert row.failed == row.hung == row.lost == row.duplicated == 0, note


async def _cut_and_restore(
    gw: Gateway,
    pub_proxy: FaultProxy,
    replay_proxy: FaultProxy,
    truth: ReplicaBlockIndex,
    truth_sub: KVEventSubscriber,
) -> tuple[Row, str]:
    async def kv() -> dict[str, Any]:
        return await asyncio.to_thread(_kv, gw, "replica-0")

    async def metric(name: str) -> float:
        return await asyncio.to_thread(gw.metric, name, replica="replica-0")

    clients = StreamingClients(gw.url, DEV_KEY, workers=8, max_tokens=64, timeout_s=20.0)
    clients.start()
    try:
        # Given the gateway following replica-0's events under traffic,
        async def following() -> bool:
            k = await kv()
            return bool(k["blocks"] > 0 and k["age_s"] is not None and k["age_s"] < 0.5)

        await _until(following, 20, "the gateway to follow replica-0's events")
        await asyncio.sleep(1.0)
        before = await kv()
        failures0 = await metric("tidal_router_kv_events_probe_failures_total")
        sources0 = await asyncio.to_thread(_index_sources, gw)
        # When the stream is cut (both the PUB and the replay connection reset, and new ones too),
        pub_proxy.cut()
        replay_proxy.cut()
        seq_at_cut = truth_sub.stats.last_seq
        await asyncio.sleep(CUT_S)
        during = await kv()
        failures = await metric("tidal_router_kv_events_probe_failures_total") - failures0
        sources_cut = await asyncio.to_thread(_index_sources, gw)
        # Then the gateway sees it (its replay questions go unanswered), the index ages past the
        # bound and decisions stop using it (one candidate exact, the other estimated: "mixed"),
        assert failures >= 1, during
        assert during["age_s"] is not None and during["age_s"] > BOUND_S, during
        mixed = sources_cut["mixed"] - sources0["mixed"]
        assert mixed >= 1, (sources0, sources_cut)
        missed = (truth_sub.stats.last_seq or 0) - (seq_at_cut or 0)
        assert missed > 0, "the replica published nothing while its stream was cut"
        # When it is restored,
        seq_at_restore = truth_sub.stats.last_seq or 0
        pub_proxy.restore()
        replay_proxy.restore()

        async def current() -> bool:
            k = await kv()
            return bool(
                k["last_seq"] is not None
                and k["last_seq"] >= seq_at_restore
                and k["age_s"] is not None
                and k["age_s"] < 0.5
            )

        # the index catches up with what it missed and is proven current again,
        recovery_s = await _until(current, 15, "replica-0's index to be current again")
        sources_back = await asyncio.to_thread(_index_sources, gw)
        await asyncio.sleep(3.0)
        sources_end = await asyncio.to_thread(_index_sources, gw)
    finally:
        await clients.stop()
    # and every decision since then used both indexes again.
    assert sources_end["exact"] > sources_back["exact"], (sources_back, sources_end)
    # Once the replica is idle, the gateway's index holds exactly the replica's blocks: the gap
    # was filled (replayed, or rebuilt from the replay buffer), not papered over.
    await asyncio.sleep(1.0)
    after = await kv()
    restarts = await metric("tidal_router_kv_events_restarts_total")
    assert after["last_seq"] == truth_sub.stats.last_seq, (after, truth_sub.stats)
    assert after["blocks"] == len(truth) and after["complete"] == truth.complete, (after, len(truth))
    gaps = after["gaps"] - before["gaps"]
    rebuilds = after["rebuilds"] - before["rebuilds"]
    assert gaps + rebuilds + restarts >= 1, after  # the loss was detected, not missed
    note = (
        f"cut {CUT_S:g} s ({missed} event batches missed, {failures:.0f} replay questions unanswered, "
        f"index {during['age_s']:.1f} s old, {mixed:.0f} decisions without it); after restore: "
        f"{gaps} gaps, {rebuilds} rebuilds, {restarts:.0f} restarts seen; index exact again "
        f"({after['blocks']} blocks = the replica's); recovery from restore to the index current"
    )
    row = record(
        clients.row("interactive", "a replica's KV-event stream cut, then restored", recovery_s, note)
    )
    return row, note
