"""Parsing vLLM's /metrics into a load snapshot (new names, old names, histograms, LoRA info)."""

from __future__ import annotations

import math

import pytest

from replicas.metrics import Histogram, parse_load_snapshot, parse_samples

V033 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:generation_tokens_total{engine="0",model_name="m"} 77.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 6.0
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.0e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 2.0e+09
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000",enable_prefix_caching="True"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 4.0
"""

OLD = """\
vllm:num_requests_running{model_name="m"} 1
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10
vllm:gpu_prefix_cache_hits_total{model_name="m"} 5
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 3
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 4
"""


def test_v033_names_are_parsed_and_summed_over_engines() -> None:
    snap = parse_load_snapshot(V033)
    assert snap.num_running == 5.0
    assert snap.num_waiting == 4.0
    assert snap.kv_cache_usage == 0.25
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (1000.0, 400.0)
    assert snap.prefix_hit_ratio == 0.4
    assert snap.num_preemptions == 2.0
    assert snap.requests_finished == 11.0
    assert snap.running_lora_adapters == {"a", "b"} and snap.waiting_lora_adapters == {"c"}
    assert snap.max_lora == 4
    assert (snap.block_size, snap.num_gpu_blocks) == (16, 1000)
    assert snap.model_names == {"m"}
    assert snap.ttft is not None and snap.ttft.count == 10.0 and snap.ttft.sum == 3.0


def test_older_names_are_tolerated() -> None:
    snap = parse_load_snapshot(OLD)
    assert snap.kv_cache_usage == 0.5
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (10, 5)
    assert snap.inter_token_latency is not None and snap.inter_token_latency.count == 4


def test_histogram_quantile_interpolates_like_promql() -> None:
    h = Histogram(((0.1, 2.0), (0.5, 8.0), (math.inf, 10.0)), sum=3.0, count=10.0)
    assert h.quantile(0.2) == pytest.approx(0.1)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * (5 - 2) / 6)
    assert h.quantile(0.99) == pytest.approx(0.5)  # falls in +Inf: the highest finite bound
    later = Histogram(((0.1, 3.0), (0.5, 12.0), (math.inf, 14.0)), sum=5.0, count=14.0)
    delta = later - h
    assert delta.count == 4.0 and delta.buckets[0] == (0.1, 1.0)
    assert math.isnan(Histogram((), 0, 0).quantile(0.5))


def test_labels_with_escapes_and_garbage_lines() -> None:
    text = 'x{a="q\\"uote,d",b="2"} 7\nnot a metric line\ny 3 1700000000\n'
    samples = list(parse_samples(text))
    assert samples[0].labels == {"a": 'q"uote,d', "b": "2"} and samples[0].value == 7
    assert samples[-1].name == "y" and samples[-1].value == 3
