"""The engine: steps on a caller's clock, vLLM's metrics, and the load snapshot."""

from __future__ import annotations

import math

import pytest

from tidal.replicas.metrics import parse_load_snapshot
from tidal.replicas.sim.engine import SimEngine
from tidal.replicas.sim.request import Request
from tidal.replicas.wire.prom import parse_samples


def run_to_end(e: SimEngine, t: float = 0.0) -> float:
    while e.has_work():
        out = e.begin_step(t)
        assert out is not None
        t += out.duration
        e.end_step(out, t)
    return t


def add(
    e: SimEngine, rid: str, tokens: list[int], max_tokens: int, now: float = 0.0, **kw: object
) -> Request:
    r = e.make_request(rid, prompt_token_ids=tokens, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    e.add_request(r, now)
    return r


def test_snapshot_round_trips_through_the_metrics_page() -> None:
    e = SimEngine("llama-3.1-8b-h100", num_gpu_blocks=300, max_model_len=2048, check_invariants=True)
    e.load_lora("tenant-a", "/never/read")
    for i in range(6):
        add(e, f"r{i}", [1] * 200 + [i] * 40, 20 + i, lora="tenant-a" if i % 2 else None)
    run_to_end(e)
    snap = e.snapshot()
    assert parse_load_snapshot(e.render_metrics()) == snap
    assert snap.requests_finished == 6 and snap.generation_tokens == sum(20 + i for i in range(6))
    assert snap.prefix_cache_queries == 6 * 240
    assert snap.prefix_cache_hits > 0 and snap.num_gpu_blocks == 300 and snap.block_size == 16
    assert snap.ttft is not None and snap.ttft.count == 6
    assert snap.inter_token_latency is not None and snap.inter_token_latency.count == sum(
        19 + i for i in range(6)
    )
    assert snap.max_lora == 4 and snap.model_names == {"llama-3.1-8b-h100"}


def test_metrics_page_has_vllm_families_types_and_labels() -> None:
    e = SimEngine("tiny-cpu", served_model_name="tiny")
    text = e.render_metrics()
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:prefix_cache_hits_total"] == "counter"
    assert types["vllm:prefix_cache_hits_created"] == "gauge"
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert types["vllm:iteration_tokens_total"] == "histogram"
    samples = {s.name: s for s in parse_samples(text)}
    assert samples["vllm:kv_cache_usage_perc"].labels == {"engine": "0", "model_name": "tiny"}
    info = samples["vllm:cache_config_info"].labels
    assert info["block_size"] == "128" and info["num_gpu_blocks"] == "8192"
    assert {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} <= set(
        next(s.labels for s in parse_samples(_after_lora_request(e)) if s.name == "vllm:lora_requests_info")
    )


def _after_lora_request(e: SimEngine) -> str:
    e.load_lora("l0", "/x")
    add(e, "lr", [5] * 10, 3, lora="l0")
    run_to_end(e)
    return e.render_metrics()


def test_lora_info_shows_running_and_waiting_adapters() -> None:
    e = SimEngine("llama-3.1-8b-h100", max_loras=1, num_gpu_blocks=200, max_model_len=1024)
    e.load_lora("a", "/a")
    e.load_lora("b", "/b")
    add(e, "x", [1] * 20, 50, lora="a")
    add(e, "y", [2] * 20, 50, lora="b")
    out = e.begin_step(0.0)
    assert out is not None
    e.end_step(out, out.duration)
    snap = e.snapshot()
    assert snap.running_lora_adapters == {"a"} and snap.waiting_lora_adapters == {"b"}
    waiting = {
        s.labels["reason"]: s.value
        for s in parse_samples(e.render_metrics())
        if s.name == "vllm:num_requests_waiting_by_reason"
    }
    assert waiting == {"capacity": 0.0, "deferred": 1.0}


def test_requests_are_capped_by_the_context_and_reject_longer_prompts() -> None:
    e = SimEngine("tiny-cpu")
    r = e.make_request("a", prompt_token_ids=[1] * 4000, max_tokens=500)
    assert r.max_tokens == 96  # 4096 - 4000
    with pytest.raises(ValueError, match="exceeds the context"):
        e.make_request("b", prompt_token_ids=[1] * 4097, max_tokens=1)
    with pytest.raises(KeyError):
        e.make_request("c", prompt_token_ids=[1], max_tokens=1, lora="not-loaded")


def test_natural_stop_finishes_with_reason_stop() -> None:
    e = SimEngine("tiny-cpu")
    add(e, "a", [1] * 10, 50, stop_after=5)
    add(e, "b", [2] * 10, 5)
    run_to_end(e)
    reasons = {
        s.labels["finished_reason"]: s.value
        for s in parse_samples(e.render_metrics())
        if s.name == "vllm:request_success_total"
    }
    assert reasons["stop"] == 1 and reasons["length"] == 1


def test_aborted_requests_free_their_blocks_and_are_not_counted_as_finished() -> None:
    e = SimEngine("tiny-cpu")
    add(e, "a", [1] * 300, 1000)
    out = e.begin_step(0.0)
    assert out is not None
    e.end_step(out, out.duration)
    assert e.snapshot().kv_cache_usage > 0
    assert e.abort_request("a") is not None and e.abort_request("a") is None
    snap = e.snapshot()
    assert snap.kv_cache_usage == 0 and snap.num_running == 0 and snap.requests_finished == 0


def test_steady_runs_in_closed_form_match_stepping() -> None:
    def build() -> SimEngine:
        e = SimEngine("llama-3.1-8b-h100", num_gpu_blocks=400, max_model_len=4096)
        for i in range(5):
            add(e, f"r{i}", [i] * (50 + 30 * i), 200 + 13 * i)
        return e

    a, b = build(), build()
    ta = tb = 0.0
    while a.has_work():
        k = a.steady_limit() if a.can_fast_forward() else 0
        if k:
            ta = a.advance_steady(ta, k)
            for _ in range(k):
                out = b.begin_step(tb)
                assert out is not None
                tb += out.duration
                b.end_step(out, tb)
        else:
            for e, t in ((a, ta), (b, tb)):
                out = e.begin_step(t)
                assert out is not None
                e.end_step(out, t + out.duration)
            ta += out.duration
            tb += out.duration
        assert math.isclose(ta, tb, rel_tol=1e-12)
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.generation_tokens == sb.generation_tokens and a.num_steps == b.num_steps
    assert sa.inter_token_latency is not None and sb.inter_token_latency is not None
    assert [c for _, c in sa.inter_token_latency.buckets] == [c for _, c in sb.inter_token_latency.buckets]
    assert math.isclose(sa.inter_token_latency.sum, sb.inter_token_latency.sum, rel_tol=1e-9)
    ma = {s.name: s.value for s in parse_samples(a.render_metrics()) if "estimated" in s.name}
    mb = {s.name: s.value for s in parse_samples(b.render_metrics()) if "estimated" in s.name}
    assert ma.keys() == mb.keys() and all(math.isclose(ma[n], mb[n], rel_tol=1e-9) for n in ma)
