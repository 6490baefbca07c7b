"""The replica client and the OpenAI SDK against a real vLLM CPU replica."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tidal.replicas.client import ReplicaClient
from tidal.replicas.errors import ReplicaModelNotFound, ReplicaRequestError
from tidal.replicas.wire.prom import parse_samples

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

LONG_SYSTEM = " ".join(f"rule {i}: answer briefly and politely." for i in range(60))  # > 2 KV blocks of 128


def test_openai_sdk_streams_a_chat_completion(vllm_replica) -> None:
    client = openai.OpenAI(base_url=vllm_replica.url + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert isinstance(text, str)


async def test_client_chat_stream_models_health(vllm_replica) -> None:
    async with ReplicaClient(vllm_replica.url) as replica:
        assert await replica.health()
        models = await replica.models()
        assert "tiny" in {m["id"] for m in models}
        reply = await replica.chat_completions(
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "ignore_eos": True,
            }
        )
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 5
        chunks = [
            c
            async for c in replica.stream_chat_completions(
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                    "ignore_eos": True,
                    "priority": 5,
                }
            )
        ]
        assert chunks[0]["object"] == "chat.completion.chunk"
        comp = await replica.completions({"model": "tiny", "prompt": "once upon", "max_tokens": 3})
        assert comp["object"] == "text_completion"


async def test_client_errors_are_typed(vllm_replica) -> None:
    async with ReplicaClient(vllm_replica.url) as replica:
        with pytest.raises(ReplicaModelNotFound) as nf:
            await replica.chat_completions({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        assert nf.value.status == 404 and nf.value.retry_safe
        with pytest.raises(ReplicaRequestError) as bad:
            await replica.chat_completions({"model": "tiny", "messages": "not a list"})
        assert bad.value.status == 400 and not bad.value.retry_safe
    async with ReplicaClient("http://127.0.0.1:9") as dead:
        assert not await dead.health(timeout=1)


async def test_metrics_move_while_requests_run(vllm_replica) -> None:
    async with ReplicaClient(vllm_replica.url) as replica:
        before = await replica.load_snapshot()
        assert before.block_size == 128 and before.num_gpu_blocks
        body = {
            "model": "tiny",
            "messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "go"}],
            "max_tokens": 1500,
            "ignore_eos": True,
        }

        async def consume() -> None:
            async for _ in replica.stream_chat_completions(body):
                pass

        tasks = [asyncio.create_task(consume()) for _ in range(6)]
        peak_running = peak_kv = 0.0
        for _ in range(200):
            snap = await replica.load_snapshot()
            peak_running = max(peak_running, snap.num_running + snap.num_waiting)
            peak_kv = max(peak_kv, snap.kv_cache_usage)
            if all(t.done() for t in tasks) or (peak_running >= 2 and peak_kv > 0):
                break
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
        after = await replica.load_snapshot()
    assert peak_running >= 2, "running/waiting never rose while six requests ran"
    assert peak_kv > 0, "KV usage never rose while requests ran"
    assert after.prefix_cache_queries > before.prefix_cache_queries
    # Six requests with the same long system prompt: all but the first hit the cached prefix blocks.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 5 * 128
    assert after.generation_tokens - before.generation_tokens >= 6 * 1500
    assert after.ttft is not None and after.ttft.count > before.ttft.count  # type: ignore[union-attr]


async def test_runtime_lora_load_and_use(vllm_replica, tiny_model_root) -> None:
    adapter = str(tiny_model_root / "adapters" / "lora-0")
    async with ReplicaClient(vllm_replica.url) as replica:
        msg = await replica.load_lora_adapter("tenant42-v3", adapter)
        assert "added successfully" in msg
        try:
            await _use_adapter(replica, "tenant42-v3")
        finally:
            assert "removed successfully" in await replica.unload_lora_adapter("tenant42-v3")


async def _use_adapter(replica: ReplicaClient, name: str) -> None:
    assert name in {m["id"] for m in await replica.models()}
    reply = await replica.chat_completions(
        {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    assert reply["model"] == name

    # While an adapter request runs, vllm:lora_requests_info lists it.
    seen: set[str] = set()
    stream = replica.stream_chat_completions(
        {
            "model": name,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 3000,
            "ignore_eos": True,
        }
    )
    async for _ in stream:
        # (The scraper's 5 s bound is not under test here: the first adapter steps on the CPU
        # backend can keep vLLM's API server from answering /metrics for longer on 2 cores.)
        snap = await replica.load_snapshot(timeout=60.0)
        seen |= snap.running_lora_adapters | snap.waiting_lora_adapters
        assert snap.max_lora == 2
        if name in seen:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    infos = [s for s in parse_samples(await replica.metrics_text()) if s.name == "vllm:lora_requests_info"]
    assert any(name in s.labels["running_lora_adapters"] for s in infos)
    assert name in seen
