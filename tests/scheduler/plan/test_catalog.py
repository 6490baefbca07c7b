"""Models and GPUs are data: KV arithmetic, presets equal to the simulator's, and user extensions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.replicas.sim.presets import get_preset
from tidal.scheduler.plan.catalog import CatalogError, load_catalog, load_prices
from tidal.scheduler.plan.planner import GIB, kv_tokens_in


def test_kv_bytes_per_token_follow_the_model_shape() -> None:
    cat = load_catalog()
    # 80 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes
    assert cat.kv_bytes_per_token("llama-3.1-70b", "bf16") == 80 * 8 * 128 * 2 * 2 == 327_680
    assert cat.kv_bytes_per_token("llama-3.1-70b", "fp8") == 163_840
    assert cat.kv_bytes_per_token("llama-3.1-8b", "bf16") == 131_072
    # about 1.6 M tokens in 500 GB (GiB) of free HBM
    assert kv_tokens_in(500 * GIB, 327_680) == 1_638_400


@pytest.mark.parametrize(
    ("model", "gpu", "tp", "weights", "preset"),
    [
        ("llama-3.1-70b", "h200", 4, "fp8", "llama-3.1-70b-fp8-h200-tp4"),
        ("llama-3.1-70b", "h200", 8, "fp8", "llama-3.1-70b-fp8-h200-tp8"),
        ("llama-3.1-70b", "h200", 1, "fp8", "llama-3.1-70b-fp8-h200-tp1"),
        ("llama-3.1-70b", "h100", 4, "bf16", "llama-3.1-70b-bf16-h100-tp4"),
        ("Meta-Llama/Llama-3.1-8B-Instruct", "H100-SXM", 1, "bf16", "llama-3.1-8b-h100"),
        ("llama-3.1-8b", "h200", 1, "bf16", "llama-3.1-8b-h200"),
    ],
)
def test_catalog_replicas_are_the_simulator_presets(
    model: str, gpu: str, tp: int, weights: str, preset: str
) -> None:
    # Given the shipped catalog, when it builds a replica, then its KV and step times are the preset's
    p = load_catalog().preset(model, gpu, tp=tp, weights="fp8" if weights == "fp8" else "bf16")
    q = get_preset(preset)
    assert p.num_gpu_blocks == q.num_gpu_blocks
    for batch, ctx in ((1, 1000), (64, 64 * 3000)):
        assert p.cost.decode_step_time(batch, ctx) == pytest.approx(
            q.cost.decode_step_time(batch, ctx), rel=1e-12
        )
    assert p.cost.prefill_time(4096) == pytest.approx(q.cost.prefill_time(4096), rel=1e-12)


def test_a_replica_that_does_not_fit_is_refused() -> None:
    with pytest.raises(CatalogError, match="no memory for the KV cache"):
        load_catalog().preset("llama-3.1-70b", "h100", tp=1, weights="bf16")
    with pytest.raises(CatalogError, match="does not divide"):
        load_catalog().preset("llama-3.1-70b", "h100", tp=3)


def test_unknown_names_list_what_is_known() -> None:
    with pytest.raises(CatalogError, match=r"unknown GPU 'b9000' \(known: h100, h200"):
        load_catalog().gpu_name("b9000")


def test_a_user_catalog_adds_and_replaces_entries(tmp_path: Path) -> None:
    extra = tmp_path / "more.yaml"
    extra.write_text(
        """
gpus:
  b200x:
    name: B200-like
    memory_mib: 184320
    hbm_tb_s: 8.0
    bf16_tflops: 2250
    fp8_tflops: 4500
    nvlink_gb_s: 900
models:
  llama-3.1-70b:   # a replaced entry: a shorter context
    layers: 80
    hidden_size: 8192
    heads: 64
    kv_heads: 8
    head_dim: 128
    intermediate_size: 28672
    vocab_size: 128256
    max_model_len: 32768
"""
    )
    cat = load_catalog(extra)
    p = cat.preset("llama-3.1-70b", "b200x", tp=2, weights="fp8")
    assert p.context_len == 32768
    assert not cat.gpus["b200x"].calibrated
    assert "h200" in cat.gpus  # the shipped ones stay


def test_a_bad_catalog_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "gpus:\n  x: {name: X, memory_mib: -1, hbm_tb_s: 1, bf16_tflops: 1, fp8_tflops: 1, nvlink_gb_s: 1}\n"
    )
    with pytest.raises(CatalogError, match=r"gpus\.x\.memory_mib"):
        load_catalog(bad)


def test_the_shipped_prices_say_they_are_examples() -> None:
    prices, path = load_prices()
    assert prices.example and "EXAMPLE" in path.read_text()
    assert prices.gpu("h200").reserved < prices.gpu("h200").on_demand
