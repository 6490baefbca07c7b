"""The capped batch under sustained load on real vLLM: the per-replica cap adapts so TPOT p95
stays under the class's SLO.

Every request carries a document of its own (about 500 tokens), so each sequence's decode reads
its own KV and every new request's prefill shares the engine's steps with the running decodes: the
tiny model's time per output token grows with the batch on the CPU (a few ms for a few streams,
50-75 ms for 64), as it does on a GPU. (A long system prompt shared by all requests is not enough:
its cached KV is read cheaply, and at 64 streams the gateway and the clients, sharing two cores
with the engine, become the limit before the engine's batch does.) The test reads the
engine's own per-request TPOT (vLLM's histogram, whose 25 ms bucket bound is the SLO):
the gateway's and the clients' timestamps add a shared machine's scheduling noise on top.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from pathlib import Path

import httpx
import openai
import pytest

from replicas.wire.prom import Histogram, parse_samples, sum_histograms
from tests.api.harness import DEV_KEY, Gateway, fleet_dict, run_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENS = 48
SLO = 0.025
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


def _histograms(gw: Gateway, replica_url: str) -> tuple[Histogram, Histogram]:
    """Per-request TPOT as the gateway measures it and as the engine does
    (``vllm:request_time_per_output_token_seconds``)."""
    return (
        _histogram(gw.url, "tidal_gateway_tpot_seconds"),
        _histogram(replica_url, "vllm:request_time_per_output_token_seconds"),
    )


async def _sustain(
    gw: Gateway,
    replica_url: str,
    workers: int,
    seconds: float,
    marks: dict[float, tuple[Histogram, Histogram]],
    first: int,
) -> None:
    """``workers`` clients stream without pause for ``seconds``, sending documents ``first``,
    ``first + 1``, ...; ``marks`` gets the histograms at each of its times (seconds from the start)."""
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0, timeout=300)
    start = time.monotonic()
    deadline = start + seconds
    sent = itertools.count(first)

    async def mark() -> None:
        for at in sorted(marks):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            marks[at] = await asyncio.to_thread(_histograms, gw, replica_url)

    async def worker() -> None:
        while time.monotonic() < deadline:
            await _one(client, next(sent))

    await asyncio.gather(mark(), *(worker() for _ in range(workers)))
    await client.close()


def _share_within(h: Histogram, limit: float) -> float:
    """Share of the observations at or under ``limit`` (a bucket bound: exact, no interpolation)."""
    at = dict(h.buckets).get(limit)
    assert at is not None, f"{limit} is not a bucket bound"
    return at / h.count if h.count else 0.0


def test_the_cap_holds_tpot_p95_under_the_slo(vllm_pair: list, tmp_path: Path) -> None:  # type: ignore[type-arg]
    url = vllm_pair[0].url

    def gateway(adaptive: bool):  # type: ignore[no-untyped-def]
        fleet = fleet_dict(
            [url], cap=64, min_cap=2 if adaptive else 64, max_queue=512, wait_budget_s=300, tpot_slo_s=SLO
        )
        return run_gateway(tmp_path, fleet)

    # Given one replica (one engine keeps a core busy; two would leave no core for the gateway and
    # the clients on a small machine) and a 25 ms TPOT SLO,
    # When 72 clients stream without pause through a gateway whose cap is pinned at 64,
    with gateway(adaptive=False) as fixed:
        marks = {6.0: (EMPTY, EMPTY), 15.0: (EMPTY, EMPTY)}
        asyncio.run(_sustain(fixed, url, workers=72, seconds=15, marks=marks, first=0))
        pinned = [b - a for a, b in zip(marks[6.0], marks[15.0], strict=True)]
    # and then through one whose cap adapts (starting at 64),
    with gateway(adaptive=True) as gw:
        marks = {20.0: (EMPTY, EMPTY), 40.0: (EMPTY, EMPTY)}
        # (other documents: the first run's are in the replica's prefix cache)
        asyncio.run(_sustain(gw, url, workers=72, seconds=40, marks=marks, first=1_000_000))
        caps = [r["cap"] for r in gw.admin("GET", "/admin/replicas").json()["data"]]
        adapted = [b - a for a, b in zip(marks[20.0], marks[40.0], strict=True)]
    facts = (
        f"SLO {SLO * 1000:.0f} ms; cap pinned at 64: per-request TPOT p95 {pinned[0].quantile(0.95) * 1000:.0f} ms at "
        f"the gateway, {_share_within(pinned[1], SLO):.1%} of requests within the SLO at the engine; adapted "
        f"(cap {caps}): {adapted[0].quantile(0.95) * 1000:.0f} ms, {_share_within(adapted[1], SLO):.1%}"
    )
    print(facts)
    # Then the pinned cap broke the SLO -- fewer than 95% of requests had a TPOT within 25 ms at
    # the engine, so the p95 is above it -- while the adaptive cap came down from 64 and brought
    # (nearly) all requests within it. On an idle machine the adapted share is above 95%; on one
    # whose cores are oversubscribed by other work, the engine is starved now and then whatever
    # its batch, so the bound below leaves room for that (the routing benchmark measures the
    # p95 on the simulator without such noise).
    assert adapted[1].count >= 50 and pinned[1].count >= 50, facts
    assert _share_within(pinned[1], SLO) < 0.95, facts
    assert all(c < 64 for c in caps), facts
    assert _share_within(adapted[1], SLO) >= max(0.85, min(0.95, _share_within(pinned[1], SLO) + 0.1)), facts
