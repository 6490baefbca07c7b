"""Admission against a real vLLM replica: 429 with Retry-After under a flood, bounded queue and
memory, overflow to an external provider (never for a regulated feature)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.harness import ADMIN_KEY, DEV_KEY, AuthProxy, Gateway, fleet_dict, play_until, run_gateway

pytestmark = pytest.mark.vllm

LONG = {"max_tokens": 64, "extra_body": {"ignore_eos": True}}


async def _flood(gw: Gateway, n: int) -> tuple[int, int, list[str], int]:
    """n concurrent streams; returns (answered, refused, Retry-After values, max queue depth seen)."""
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0, timeout=120)
    ok = refused = 0
    retry_after: list[str] = []
    depth = 0
    done = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal ok, refused
        try:
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"flood {i}"}], stream=True, **LONG
            )
            async for _ in stream:
                pass
            ok += 1
        except openai.RateLimitError as err:
            refused += 1
            retry_after.append(err.response.headers.get("retry-after", ""))

    async def watch() -> None:
        nonlocal depth
        async with httpx.AsyncClient() as http:
            while not done.is_set():
                load = (
                    await http.get(gw.url + "/admin/load", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                ).json()
                depth = max(depth, load["pools"]["interactive"]["queue_depth"])
                await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(one(i) for i in range(n)))
    done.set()
    await watcher
    await client.close()
    return ok, refused, retry_after, depth


def test_a_flood_gets_429_with_retry_after_and_nothing_grows(
    vllm_pair: list,
    tmp_path: Path,  # type: ignore[type-arg]
) -> None:
    # Given one replica capped at 2 in-flight requests and a gateway queue of 4,
    fleet = fleet_dict([vllm_pair[0].url], cap=2, min_cap=2, max_queue=4, wait_budget_s=1.0)
    with run_gateway(tmp_path, fleet) as gw:
        # When 60 clients stream at once (twice: the second flood measures steady state),
        asyncio.run(_flood(gw, 60))
        rss_warm = gw.rss_bytes()
        ok, refused, retry_after, depth = asyncio.run(_flood(gw, 60))
        rss_after = gw.rss_bytes()
        # Then some are served, the rest are refused with a Retry-After of whole seconds,
        assert ok >= 2 and refused >= 30 and ok + refused == 60
        assert all(v.isdigit() and 1 <= int(v) <= 300 for v in retry_after)
        # the queue never held more than its limit, the gateway's memory did not grow,
        assert depth <= 4
        assert rss_after - rss_warm < 8 * 1024 * 1024, (rss_warm, rss_after)
        # and each outcome was counted.
        assert gw.metric("tidal_admission_outcomes_total", outcome="rejected_429") >= refused
        assert gw.metric("tidal_admission_outcomes_total", outcome="queued") >= 1
        assert gw.admin("GET", "/admin/load").json()["pools"]["interactive"]["queue_depth"] == 0


def test_overflow_goes_to_the_external_provider_but_never_for_a_regulated_feature(
    vllm_pair: list,
    tmp_path: Path,  # type: ignore[type-arg]
) -> None:
    # Given a pool of one replica with one slot and no queue, and an external provider (another
    # replica behind its own key),
    with AuthProxy(upstream=vllm_pair[1].url, key="ext-secret") as provider:
        fleet = fleet_dict([vllm_pair[0].url], cap=1, min_cap=1, max_queue=0, external=provider.url)
        with run_gateway(tmp_path, fleet, env={"TIDAL_TEST_PROVIDER_KEY": "ext-secret"}) as gw:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)
            # a pinned ("hard") feature goes to the provider even when the pool is idle,
            reply = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hard task"}],
                max_tokens=3,
                extra_headers={"X-Tidal-Feature": "hard"},
            )
            assert reply.choices and provider.requests == 1

            def while_the_slot_is_busy() -> _Play:
                """Occupy the only slot with a long stream, then send an ordinary request and a
                regulated one."""
                first_token, stop = threading.Event(), threading.Event()

                def occupy() -> None:
                    stream = client.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": "long"}],
                        stream=True,
                        max_tokens=2900,
                        extra_body={"ignore_eos": True},
                    )
                    for _ in stream:
                        first_token.set()
                        if stop.is_set():
                            stream.close()
                            return

                holder = threading.Thread(target=occupy)
                holder.start()
                try:
                    assert first_token.wait(60)
                    before = provider.requests
                    reply = client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "overflow me"}], max_tokens=3
                    )
                    assert reply.choices
                    overflowed = provider.requests - before
                    try:
                        client.chat.completions.create(
                            model="tiny",
                            messages=[{"role": "user", "content": "claim data"}],
                            max_tokens=3,
                            extra_headers={"X-Tidal-Feature": "claims"},
                        )
                        refused = None
                    except openai.RateLimitError as err:
                        refused = err.response.headers.get("retry-after", "")
                    # The slot is held now, so it was held all along: the stream is its only user.
                    held = [r["inflight"] for r in gw.admin("GET", "/admin/replicas").json()["data"]] == [1]
                    return _Play(held, overflowed, refused, provider.requests - before - overflowed)
                finally:
                    stop.set()
                    holder.join(60)

            # When the only slot is busy with a long stream (played until the stream held the
            # slot throughout),
            plays = play_until(while_the_slot_is_busy, lambda p: p.held)
            # Then a regulated feature's request never reached the provider, in any play,
            assert all(p.regulated_at_provider == 0 for p in plays), plays
            # and while the slot was held, an ordinary request overflowed to the provider and was
            # answered, while the regulated one stayed home and got 429 + Retry-After.
            held = plays[-1]
            assert held.held, plays
            assert held.overflowed == 1 and held.retry_after is not None and held.retry_after.isdigit(), plays
            assert provider.refused == 0
            overflowed = sum(p.overflowed for p in plays)
            refused = sum(p.retry_after is not None for p in plays)
            assert (
                gw.metric("tidal_admission_outcomes_total", outcome="overflowed", feature="default")
                == overflowed
            )
            assert (
                gw.metric("tidal_admission_outcomes_total", outcome="rejected_429", feature="claims")
                == refused
            )


@dataclass(frozen=True)
class _Play:
    held: bool  # the long stream still held the slot after both requests
    overflowed: int  # ordinary requests the provider received
    retry_after: str | None  # the regulated request's Retry-After when refused, None when served
    regulated_at_provider: int
