"""The gateway in front of two real vLLM CPU replicas, driven by the official openai SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.harness import DEV_KEY, Gateway, fleet_dict, play_until, run_gateway
from tidal.replicas.metrics import parse_load_snapshot

pytestmark = pytest.mark.vllm

SYSTEM = " ".join(f"Rule {i}: answer the customer briefly, politely and in English." for i in range(40))


@pytest.fixture(scope="module")
def gateway(
    vllm_pair: list, tiny_model_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:  # type: ignore[type-arg]
    adapters = {"support-v1": str(tiny_model_root / "adapters" / "lora-0")}
    fleet = fleet_dict([p.url for p in vllm_pair], adapters=adapters)
    with run_gateway(tmp_path_factory.mktemp("gw"), fleet) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=DEV_KEY, max_retries=0)


def _decisions(gw: Gateway) -> dict[str, float]:
    return {labels["replica"]: value for labels, value in gw.samples("tidal_router_decisions_total")}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def test_streaming_chat_completions_and_models_through_the_sdk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    )

    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert (
        reply.object == "chat.completion" and reply.usage is not None and reply.usage.completion_tokens == 5
    )

    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt="once upon a time", max_tokens=6, stream=True)
        if c.choices
    )
    assert isinstance(text, str)
    assert {m.id for m in client.models.list()} == {"tiny", "support-v1"}


def test_raw_sse_passes_through_chunk_by_chunk(gateway: Gateway) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    with gateway.sse(body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_a_conversation_stays_on_one_replica_and_hits_its_prefix_cache(
    gateway: Gateway,
    client: openai.OpenAI,
    vllm_pair: list,  # type: ignore[type-arg]
) -> None:
    # Given a long system prompt (several 128-token KV blocks) and one conversation on it,
    before_hits = [
        parse_load_snapshot(httpx.get(p.url + "/metrics").text).prefix_cache_hits for p in vllm_pair
    ]
    before = _decisions(gateway)
    cached_before = gateway.metric("tidal_router_prefill_cost_total", result="cached")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my order 1234?"}]
    # When six turns of it go through the gateway,
    for turn in range(6):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or "ok"},
            {"role": "user", "content": f"And what about item {turn}?"},
        ]
    # Then all of them landed on the same replica: the first where the prefix ring and the load
    # put it, turns 2..6 where the gateway's KV index knows their history is cached,
    moved = _delta(_decisions(gateway), before)
    assert len(moved) == 1 and next(iter(moved.values())) == 6, moved
    assert gateway.metric("tidal_router_prefill_cost_total", result="cached") - cached_before == 5
    # and that replica's real vLLM prefix cache served the shared blocks of turns 2..6.
    chosen = int(next(iter(moved)).split("-")[1])
    after_hits = [
        parse_load_snapshot(httpx.get(p.url + "/metrics").text).prefix_cache_hits for p in vllm_pair
    ]
    gained = [a - b for a, b in zip(after_hits, before_hits, strict=True)]
    assert gained[chosen] >= 5 * 2 * 128, gained
    assert gained[1 - chosen] == 0, gained


def test_a_lora_adapter_is_loaded_on_one_replica_and_later_requests_follow_it(
    gateway: Gateway,
    client: openai.OpenAI,
    vllm_pair: list,  # type: ignore[type-arg]
) -> None:
    loads_before = gateway.metric("tidal_router_adapter_loads_total")
    before = _decisions(gateway)
    try:
        for i in range(4):
            reply = client.chat.completions.create(
                model="support-v1", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=3
            )
            assert reply.model == "support-v1"
        moved = _delta(_decisions(gateway), before)
        assert len(moved) == 1, moved  # every request went where the adapter is
        assert gateway.metric("tidal_router_adapter_loads_total") - loads_before == 1
        holders = [
            p.url
            for p in vllm_pair
            if "support-v1" in {m["id"] for m in httpx.get(p.url + "/v1/models").json()["data"]}
        ]
        assert len(holders) == 1
    finally:
        for p in vllm_pair:
            httpx.post(p.url + "/v1/unload_lora_adapter", json={"lora_name": "support-v1"}, timeout=30)


def test_admin_views_see_the_replicas(gateway: Gateway) -> None:
    replicas = gateway.admin("GET", "/admin/replicas").json()["data"]
    assert [r["name"] for r in replicas] == ["replica-0", "replica-1"]
    assert all(r["snapshot"] is not None and r["snapshot_age_s"] < 5 for r in replicas)
    load = gateway.admin("GET", "/admin/load").json()
    pool = load["pools"]["interactive"]
    assert pool["replicas_healthy"] == 2 and pool["queue_depth"] == 0
    assert "stable" in load["groups"]


def test_a_client_disconnect_aborts_the_request_upstream(gateway: Gateway, vllm_pair: list) -> None:  # type: ignore[type-arg]
    # Given a long stream (2500 tokens, about 5 s here) in progress through the gateway,
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a very long story"}],
        "max_tokens": 2500,
        "stream": True,
        "ignore_eos": True,
    }

    def generated() -> float:
        return sum(
            parse_load_snapshot(httpx.get(p.url + "/metrics").text).generation_tokens for p in vllm_pair
        )

    def stream_and_hang_up() -> float:
        """Tokens vLLM generated for a 2500-token stream whose client left after a few."""
        before = generated()
        with gateway.sse(body) as resp:
            lines = resp.iter_lines()
            for _ in range(5):
                next(lines)
        settled, deadline = generated(), time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = generated()
            if now == settled:
                break
            settled = now
        return settled - before

    # When the client goes away after a few tokens,
    # Then vLLM stops generating for it before the end (read on vLLM's own token counter, not its
    # running gauge, which lags; played until a stream is cut short: without the abort every
    # play runs to 2500),
    spent = play_until(stream_and_hang_up, lambda s: 0 < s < 2500)
    assert 0 < spent[-1] < 2500, spent
    # and the gateway's in-flight count is zero again.
    inflight = [r["inflight"] for r in gateway.admin("GET", "/admin/replicas").json()["data"]]
    assert inflight == [0, 0]
