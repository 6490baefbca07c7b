"""The roofline cost model and the presets."""

from __future__ import annotations

import math

import pytest

from tidal.replicas.sim.cost import H100, H200, LLAMA_3_1_8B, LLAMA_3_1_70B, LLAMA_3_1_70B_FP8, CostModel
from tidal.replicas.sim.presets import PRESETS, get_preset

REQUIRED = {
    "tiny-cpu",
    "llama-3.1-70b-fp8-h200-tp4",
    "llama-3.1-70b-fp8-h200-tp8",
    "llama-3.1-70b-bf16-h100-tp4",
    "llama-3.1-8b-h100",
}


def test_the_required_presets_exist() -> None:
    assert set(PRESETS) >= REQUIRED
    assert any(p.is_embedding for p in PRESETS.values())
    with pytest.raises(KeyError, match="known"):
        get_preset("gpt-17")


@pytest.mark.parametrize(
    ("model", "tp", "per_gpu"),
    [
        (LLAMA_3_1_70B, 4, 81920),
        (LLAMA_3_1_70B, 8, 40960),
        (LLAMA_3_1_8B, 1, 131072),
        (LLAMA_3_1_70B_FP8.with_kv_dtype(1.0), 4, 40960),
    ],
)
def test_kv_bytes_per_token_follow_the_architecture(model: object, tp: int, per_gpu: int) -> None:
    # 2 (K,V) x layers x KV heads per GPU x head_dim x bytes (reference/vllm_api.md section 6).
    assert CostModel(model, H100, tp).kv_bytes_per_token_per_gpu() == per_gpu  # type: ignore[arg-type]


def test_kv_capacity_of_the_presets_is_what_the_memory_leaves() -> None:
    # H200 TP4 with FP8 weights: ~18 GB of weights per GPU, ~1.4 M tokens of BF16 KV (~89 k blocks).
    p = get_preset("llama-3.1-70b-fp8-h200-tp4")
    assert 80_000 < p.num_gpu_blocks < 95_000
    # H100 TP4 BF16: ~35 GB of weights per GPU leaves about half as much.
    q = get_preset("llama-3.1-70b-bf16-h100-tp4")
    assert 25_000 < q.num_gpu_blocks < 40_000
    assert get_preset("tiny-cpu").num_gpu_blocks == 8192 and get_preset("tiny-cpu").block_size == 128


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    c = CostModel(LLAMA_3_1_70B_FP8, H200, 4)
    one, eight = c.decode_step_time(1, 1000), c.decode_step_time(8, 8000)
    assert eight < 1.3 * one  # batching decodes is nearly free
    weights_floor = LLAMA_3_1_70B_FP8.weight_bytes / 4 / H200.hbm_bandwidth
    assert one > weights_floor
    # A long prefill grows about linearly (plus the quadratic attention term).
    p2k, p8k = c.prefill_time(2048), c.prefill_time(8192)
    assert 3.5 < p8k / p2k < 6
    # A faster memory system helps decode: the same step on H100 is slower.
    assert CostModel(LLAMA_3_1_70B_FP8, H100, 4).decode_step_time(8, 8000) > eight


def test_decode_terms_are_the_step_time_of_a_decode_batch() -> None:
    c = CostModel(LLAMA_3_1_8B, H100, 1)
    a, s = c.decode_terms(7)
    for ctx in (0, 100, 70_000):
        assert math.isclose(a + s * ctx, c.step_time(7, 7, 7, ctx, ctx + 7), rel_tol=1e-12)
    flops, read, write = c.decode_run_work(7, 1000, 3)
    one = [c.step_cost(7, 7, 7, 1000 + 7 * j, 1000 + 7 * j + 7) for j in range(3)]
    assert math.isclose(flops, sum(x.flops for x in one), rel_tol=1e-12)
    assert math.isclose(read, sum(x.read_bytes for x in one), rel_tol=1e-12)
    assert math.isclose(write, sum(x.write_bytes for x in one), rel_tol=1e-12)
