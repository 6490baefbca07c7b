"""Parsing vLLM's /metrics into a load snapshot (new names, old names, histograms, LoRA info,
data-parallel engines)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.replicas.sim.test_engine import run_to_end
from tidal.replicas import metrics
from tidal.replicas.metrics import parse_load_snapshot
from tidal.replicas.sim.engine import SimEngine
from tidal.replicas.wire.prom import PromParseError

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


# A data-parallel vLLM (two engines) in the middle of work: vLLM 0.33's layout.
TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 50.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
vllm:prefix_cache_hits_created{engine="1",model_name="m"} 1.7e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 3.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
"""


def _engines(*lines: str) -> str:
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("page", "field", "expected"),
    [
        # KV-cache usage is each engine's fraction: the replica's is their mean, never above 1.
        (TWO_ENGINES, "kv_cache_usage", 0.6),
        (
            _engines('vllm:kv_cache_usage_perc{engine="0"} 0.2', 'vllm:kv_cache_usage_perc{engine="1"} 0.9'),
            "kv_cache_usage",
            0.55,
        ),
        (
            _engines(
                'vllm:gpu_cache_usage_perc{engine="0"} 1.0', 'vllm:gpu_cache_usage_perc{engine="1"} 1.0'
            ),
            "kv_cache_usage",
            1.0,
        ),
        # Request counts and counters add up.
        (TWO_ENGINES, "num_waiting", 7.0),
        (TWO_ENGINES, "num_running", 7.0),
        (TWO_ENGINES, "prefix_cache_hits", 150.0),
        (
            _engines('vllm:num_preemptions{engine="0"} 1', 'vllm:num_preemptions_total{engine="1"} 2'),
            "num_preemptions",
            3.0,
        ),
        # Each engine has its own cache: the replica has the blocks of both.
        (TWO_ENGINES, "num_gpu_blocks", 2000),
        (TWO_ENGINES, "block_size", 16),
    ],
)
def test_data_parallel_engines_combine_as_vllm_means_them(page: str, field: str, expected: float) -> None:
    assert getattr(parse_load_snapshot(page), field) == pytest.approx(expected)


def test_data_parallel_histograms_add_bucket_by_bucket() -> None:
    ttft = parse_load_snapshot(TWO_ENGINES).ttft
    assert ttft is not None
    assert ttft.buckets == ((0.1, 4.0), (math.inf, 5.0)) and ttft.sum == pytest.approx(0.75)


def test_a_two_engine_simulated_replica_reads_as_its_engines_together() -> None:
    engines = [
        SimEngine("llama-3.1-8b-h100", engine_index=i, num_gpu_blocks=200, max_model_len=2048) for i in (0, 1)
    ]
    for i, e in enumerate(engines):
        for j in range(3 + i):
            e.add_request(
                e.make_request(f"r{j}", prompt_token_ids=[i] * 800 + [j] * 40, max_tokens=8), now=0.0
            )
        t = 0.0
        for _ in range(2 + i):
            out = e.begin_step(t)
            assert out is not None
            t += out.duration
            e.end_step(out, t)
    registry = CollectorRegistry()
    for e in engines:
        registry.register(e)
    snap = parse_load_snapshot(generate_latest(registry).decode())
    parts = [e.snapshot() for e in engines]
    assert snap.kv_cache_usage == pytest.approx(sum(p.kv_cache_usage for p in parts) / 2)
    assert 0 < snap.kv_cache_usage <= 1
    assert snap.num_running + snap.num_waiting == sum(p.num_running + p.num_waiting for p in parts) == 7
    assert snap.num_gpu_blocks == 400
    assert snap.ttft is not None and snap.ttft.count == sum(p.ttft.count for p in parts if p.ttft)


def test_a_malformed_page_raises_what_the_scraper_catches() -> None:
    with pytest.raises(PromParseError) as e:
        parse_load_snapshot('vllm:num_requests_waiting{engine="0"} 3\nvllm:num_requests_wait')
    assert isinstance(e.value, ValueError)


def test_the_snapshot_of_the_lines_it_reads_is_that_of_the_whole_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A scrape parses only the series the snapshot holds; reading the whole page gives the same.
    e = SimEngine("llama-3.1-8b-h100", max_loras=2)
    for j in range(3):
        e.add_request(e.make_request(f"r{j}", prompt_token_ids=[j] * 300, max_tokens=6), now=0.0)
    run_to_end(e)
    text = e.render_metrics()
    read = parse_load_snapshot(text)
    whole = metrics.parse_samples
    monkeypatch.setattr(metrics, "parse_samples", lambda page, names=None: whole(page))
    assert parse_load_snapshot(text) == read
    assert read.ttft is not None and read.ttft.count == 3 and read.requests_finished == 3
    assert read.model_names and read.num_gpu_blocks
