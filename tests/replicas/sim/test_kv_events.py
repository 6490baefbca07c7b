"""The simulator publishes vLLM's KV events from its block pool.

Given a dozen 16-token blocks (one is the null block) and requests written out token by token, the
stores, evictions and resets come out in the order vLLM's block pool emits them, with vLLM's
block hashes for the same token ids; the HTTP server publishes them over ZMQ with a replay socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from tests.replicas.sim.conftest import run_sim
from tidal.replicas.launcher import free_port
from tidal.replicas.sim.engine import SimEngine
from tidal.replicas.wire.kv_events import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    KVEventsConfig,
    KVEventSubscriber,
    external_hash,
)

BS = 16


def engine(blocks: int = 12) -> tuple[SimEngine, list[list[KVCacheEvent]]]:
    e = SimEngine(
        "llama-3.1-8b-h100",
        num_gpu_blocks=blocks,
        max_model_len=128,
        enable_kv_cache_events=True,
        check_invariants=True,
    )
    batches: list[list[KVCacheEvent]] = []
    e.on_kv_events = batches.append
    return e, batches


def run(e: SimEngine, rid: str, tokens: list[int], max_tokens: int, **kw: object) -> None:
    e.add_request(e.make_request(rid, prompt_token_ids=tokens, max_tokens=max_tokens, **kw), 0.0)  # type: ignore[arg-type]
    t = 0.0
    while e.has_work():
        out = e.begin_step(t)
        assert out is not None
        t += out.duration
        e.end_step(out, t)


def vllm_hashes(tokens: list[int], extra: tuple[tuple[str, ...], ...] | None = None) -> list[int]:
    return [external_hash(d) for d in BlockHasher("sha256").chain(tokens, BS, extra=extra)]


def describe(batches: list[list[KVCacheEvent]]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for b in batches:
        for ev in b:
            if isinstance(ev, BlockStored):
                out.append(
                    ("stored", len(ev.block_hashes), ev.parent_block_hash is not None, len(ev.token_ids))
                )
            elif isinstance(ev, BlockRemoved):
                out.append(("removed", tuple(ev.block_hashes)))
            else:
                out.append(("cleared",))
    return out


def test_a_prefill_stores_its_full_blocks_with_vllms_hashes() -> None:
    e, batches = engine()
    prompt = list(range(1, 41))  # 2 full blocks and 8 tokens
    run(e, "a", prompt, max_tokens=2)
    (ev,) = batches[0]
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == vllm_hashes(prompt) and ev.parent_block_hash is None
    assert ev.token_ids == prompt[:32] and ev.block_size == BS and ev.medium == "GPU"
    assert (ev.lora_id, ev.lora_name, ev.extra_keys, ev.group_idx) == (None, None, [None, None], 0)
    assert len(batches) == 1  # 41 tokens in KV at the end: no third full block


def test_a_prefix_hit_stores_only_new_blocks_chained_to_the_hit() -> None:
    e, batches = engine()
    prompt = list(range(1, 41))
    run(e, "a", prompt, max_tokens=2)
    run(e, "b", prompt[:32] + list(range(100, 120)), max_tokens=1)
    (ev,) = batches[-1]
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash == vllm_hashes(prompt)[1]
    assert ev.block_hashes == vllm_hashes(prompt[:32] + list(range(100, 120)))[2:]


def test_decode_fills_blocks_and_evictions_follow_the_lru_order() -> None:
    # 11 usable blocks. A: 48 prompt + 20 output -> its 4th block fills while decoding.
    e, batches = engine()
    a = list(range(1, 49))
    run(e, "a", a, max_tokens=20)
    assert describe(batches) == [("stored", 3, False, 48), ("stored", 1, True, 16)]
    # Free queue after A: its uncached tail block first, then its cached blocks tail first.
    # B takes 5 fresh blocks; C's 5 take the last fresh ones and then A's blocks 4, 3, 2.
    run(e, "b", list(range(200, 280)), max_tokens=1)
    run(e, "c", list(range(300, 380)), max_tokens=1)
    a_hashes = vllm_hashes(a) + [batches[1][0].block_hashes[0]]  # type: ignore[attr-defined]
    removed = [ev[1][0] for ev in describe(batches) if ev[0] == "removed"]
    assert removed == [a_hashes[3], a_hashes[2], a_hashes[1]]
    assert [ev[0] for ev in describe(batches)[2:]] == ["stored", "removed", "removed", "removed", "stored"]


def test_a_reset_is_published_with_the_next_step() -> None:
    e, batches = engine()
    run(e, "a", list(range(1, 41)), max_tokens=1)
    assert e.reset_prefix_cache()
    assert batches[-1] != [AllBlocksCleared()]  # not yet: vLLM publishes once per engine step
    run(e, "b", list(range(500, 540)), max_tokens=1)
    assert isinstance(batches[-1][0], AllBlocksCleared) and isinstance(batches[-1][1], BlockStored)


def test_lora_blocks_carry_the_adapter_and_hash_its_name_and_path() -> None:
    e, batches = engine()
    e.load_lora("ad", "/loras/ad")
    prompt = list(range(1, 41))
    run(e, "a", prompt, max_tokens=1, lora="ad")
    (ev,) = batches[0]
    assert isinstance(ev, BlockStored)
    assert (ev.lora_id, ev.lora_name, ev.extra_keys) == (1, "ad", [("ad",), ("ad",)])
    assert ev.block_hashes == vllm_hashes(prompt, extra=(("lora", "ad", "/loras/ad"),))


def test_events_off_cost_nothing_and_say_nothing() -> None:
    e = SimEngine("llama-3.1-8b-h100", num_gpu_blocks=12, max_model_len=128)
    got: list[object] = []
    e.on_kv_events = got.append
    run(e, "a", list(range(1, 41)), max_tokens=1)
    assert got == [] and e.block_pool.kv_event_queue is None


# -- the HTTP server publishes them ----------------------------------------------------------------


class Collect:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self.resets: list[bool] = []

    def apply(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def reset(self, *, complete: bool) -> None:
        self.resets.append(complete)

    def synced(self, at: float) -> None:
        pass


@pytest.mark.anyio
async def test_the_server_publishes_over_zmq_with_replay_and_resets_in_dev_mode(
    sim_server: Callable[..., object],
) -> None:
    pub, replay = free_port(), free_port()
    kv = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{pub}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        topic="kv",
    )
    sink = Collect()
    with run_sim(preset="tiny-cpu", served_model_names=["tiny"], kv_events=kv, dev_mode=True) as s:  # type: ignore[attr-defined]
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            sources = (await c.get("/kv_event_sources")).json()
            assert sources["0"]["endpoint"] == f"tcp://*:{pub}" and sources["0"]["topic"] == "kv"
            prompt = " ".join(["word"] * 300)
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200
            # A subscriber that comes later catches up through the replay socket.
            sub = KVEventSubscriber(
                f"tcp://127.0.0.1:{pub}", sink, replay_endpoint=f"tcp://127.0.0.1:{replay}", topic="kv"
            )
            task = asyncio.create_task(sub.run())
            try:
                for _ in range(200):
                    if sink.batches:
                        break
                    await asyncio.sleep(0.02)
                assert (await c.post("/reset_prefix_cache")).json() == {"success": True}
                await c.post("/v1/completions", json={"model": "tiny", "prompt": "x " * 200, "max_tokens": 1})
                for _ in range(200):
                    if len(sink.batches) >= 2:
                        break
                    await asyncio.sleep(0.02)
            finally:
                task.cancel()
    first, second = sink.batches[:2]
    assert sink.resets == [True] and sub.stats.replayed >= 1
    (stored,) = first.events
    assert isinstance(stored, BlockStored) and stored.block_size == 128 and len(stored.block_hashes) >= 2
    assert len(stored.token_ids) == 128 * len(stored.block_hashes)
    assert isinstance(second.events[0], AllBlocksCleared)


@pytest.mark.anyio
async def test_without_events_there_are_no_sources_and_no_reset_route(
    sim_server: Callable[..., object],
) -> None:
    with run_sim(preset="tiny-cpu") as s:  # type: ignore[attr-defined]
        async with httpx.AsyncClient(base_url=s.url) as c:
            assert (await c.get("/kv_event_sources")).json() == {}
            assert (await c.post("/reset_prefix_cache")).status_code == 404
