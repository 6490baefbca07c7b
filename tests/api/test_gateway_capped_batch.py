"""The capped batch under sustained load on real vLLM: the per-replica cap adapts so TPOT p95
stays under the class's SLO.

Every request carries a document of its own (about 500 tokens), so each sequence's decode reads
its own KV and every new request's prefill shares the engine's steps with the running decodes: the
tiny model's time per output token grows with the batch on the CPU (a few ms for a few streams,
50-75 ms for 64), as it does on a GPU. (A long system prompt shared by all requests is not enough:
its cached KV is read cheaply, and at 64 streams the gateway and the clients, sharing two cores
with the engine, become the limit before the engine's batch does.) The test reads the
engine's own per-request TPOT (vLLM's histogram; the SLO is one of its bucket bounds, set from
what two streams take on this machine): the gateway's and the clients' timestamps add a shared
machine's scheduling noise on top. Phases are counted in completions, not seconds, so a slower
machine runs the same test, only for longer.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.harness import DEV_KEY, fleet_dict, run_gateway
from tidal.replicas.wire.prom import Histogram, parse_samples, sum_histograms

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENS = 48
EMPTY = Histogram()
COLOURS = ("blue", "red", "grey", "green", "gold")


def _document(i: int) -> str:
    """Request i's own document, about 500 tokens."""
    rnd = random.Random(i)
    return " ".join(f"fact {rnd.randrange(10**6)}: the sky is {rnd.choice(COLOURS)}." for _ in range(40))


async def _one(client: openai.AsyncOpenAI, i: int) -> None:
    """Stream request i to its end."""
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Summarise: {_document(i)}"}],
        max_tokens=TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for _ in stream:
        pass


def _histogram(url: str, name: str) -> Histogram:
    """The histogram ``name`` from ``url``'s ``/metrics``, summed over its label sets."""
    return sum_histograms(parse_samples(httpx.get(url + "/metrics", timeout=10).text)).get(name, EMPTY)


async def _sustain(
    url: str,
    key: str,
    replica_url: str,
    workers: int,
    warmup: tuple[int, float],
    measure: tuple[int, float],
    first: int,
    seconds: float = 300,
) -> tuple[Histogram, Histogram]:
    """``workers`` clients of ``url`` (a gateway or the replica itself) stream without pause,
    sending documents ``first``, ``first + 1``, ...; after a warm-up of at least ``warmup``
    (requests the engine finished, seconds), a window of at least ``measure`` is measured: the
    gateway's and the engine's TPOT histograms over it. The counts make a slower machine measure
    the same phases, only later; ``seconds`` bounds the whole."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=seconds)
    gateway = url != replica_url
    sent = itertools.count(first)

    def snapshot() -> tuple[Histogram, Histogram]:
        engine = _histogram(replica_url, "vllm:request_time_per_output_token_seconds")
        return (_histogram(url, "tidal_gateway_tpot_seconds") if gateway else EMPTY), engine

    async def worker() -> None:
        while True:
            await _one(client, next(sent))

    tasks = [asyncio.create_task(worker()) for _ in range(workers)]
    start = time.monotonic()
    try:
        base = await asyncio.to_thread(snapshot)
        marks = [base]
        for count, span in (warmup, measure):
            since, began = marks[-1], time.monotonic()
            while time.monotonic() - start < seconds:
                now = await asyncio.to_thread(snapshot)
                if now[1].count - since[1].count >= count and time.monotonic() - began >= span:
                    marks.append(now)
                    break
                await asyncio.sleep(0.25)
        if len(marks) < 3:
            marks += [await asyncio.to_thread(snapshot)] * (3 - len(marks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    return marks[2][0] - marks[1][0], marks[2][1] - marks[1][1]


def _bound_above(h: Histogram, share: float) -> float:
    """The smallest bucket bound with at least ``share`` of ``h``'s observations at or under it."""
    return next((b for b, n in h.buckets if h.count and n / h.count >= share), math.inf)


def _share_within(h: Histogram, limit: float) -> float:
    """Share of the observations at or under ``limit`` (a bucket bound: exact, no interpolation)."""
    at = dict(h.buckets).get(limit)
    assert at is not None, f"{limit} is not a bucket bound"
    return at / h.count if h.count else 0.0


def test_the_cap_holds_tpot_p95_under_the_slo(vllm_pair: list, tmp_path: Path) -> None:  # type: ignore[type-arg]
    url = vllm_pair[0].url
    # Given one replica (one engine keeps a core busy; two would leave no core for the gateway and
    # the clients on a small machine) and a TPOT SLO set from what this machine's engine does for
    # two streams -- the next bucket bound of vLLM's histogram at or above 2.5 times their median
    # TPOT (25 ms where two streams take 10 ms: the CPU's speed moves the scale, not the shape),
    calibration = _sustain(url, "none", url, workers=2, warmup=(4, 0), measure=(24, 0), first=2_000_000)
    low = asyncio.run(calibration)[1]
    slo = next(b for b, _ in low.buckets if b >= max(0.025, 2.5 * _bound_above(low, 0.5)))

    def gateway(adaptive: bool):  # type: ignore[no-untyped-def]
        fleet = fleet_dict(
            [url], cap=64, min_cap=2 if adaptive else 64, max_queue=512, wait_budget_s=300, tpot_slo_s=slo
        )
        return run_gateway(tmp_path, fleet)

    # When 72 clients stream without pause through a gateway whose cap is pinned at 64 (measured
    # after the first wave of 64 and 6 s),
    with gateway(adaptive=False) as fixed:
        pinned = asyncio.run(
            _sustain(fixed.url, DEV_KEY, url, workers=72, warmup=(64, 6), measure=(60, 9), first=0)
        )
    # and then through one whose cap adapts (starting at 64; measured once it has had 20 s and two
    # waves to come down),
    with gateway(adaptive=True) as gw:
        # (other documents: the first run's are in the replica's prefix cache)
        adapted = asyncio.run(
            _sustain(gw.url, DEV_KEY, url, workers=72, warmup=(128, 20), measure=(60, 20), first=1_000_000)
        )
        caps = [r["cap"] for r in gw.admin("GET", "/admin/replicas").json()["data"]]
    facts = (
        f"two streams: engine TPOT median <= {_bound_above(low, 0.5) * 1000:.0f} ms, so SLO {slo * 1000:.0f} ms; "
        f"cap pinned at 64: per-request TPOT p95 {pinned[0].quantile(0.95) * 1000:.0f} ms at the gateway, "
        f"{_share_within(pinned[1], slo):.1%} of requests within the SLO at the engine; adapted "
        f"(cap {caps}): {adapted[0].quantile(0.95) * 1000:.0f} ms, {_share_within(adapted[1], slo):.1%}"
    )
    print(facts)
    # Then the pinned cap broke the SLO -- fewer than 95% of requests had a TPOT within it at the
    # engine, so the p95 is above it -- while the adaptive cap came down from 64 and brought
    # (nearly) all requests within it. On an idle machine the adapted share is above 95%; on one
    # whose cores are oversubscribed by other work, the engine is starved now and then whatever
    # its batch, so the bound below leaves room for that (the routing benchmark measures the
    # p95 on the simulator without such noise).
    assert adapted[1].count >= 50 and pinned[1].count >= 50, facts
    assert _share_within(pinned[1], slo) < 0.95, facts
    assert all(c < 64 for c in caps), facts
    assert _share_within(adapted[1], slo) >= max(0.85, min(0.95, _share_within(pinned[1], slo) + 0.1)), facts
