"""``tidal sim``: run a simulated vLLM replica, list presets, check the cost model."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

__all__ = ["sim"]

_HELP = """Run a simulated vLLM replica: vLLM's OpenAI-compatible API and /metrics, backed by an
engine with vLLM v1's scheduler (continuous batching, chunked prefill, paged KV with prefix
caching, preemption, LoRA slots) whose step times come from a roofline model of the preset's
model and GPUs. No GPU needed.

\b
Examples:
  tidal sim --preset llama-3.1-8b-h100 --port 8000 --served-model-name llama-3.1-8b-instruct
  tidal sim --preset tiny-cpu --port 8001 --served-model-name tiny --tokenizer /tmp/tiny/model
  tidal sim --preset fast-test --port 8002 --time-scale 10
  tidal sim --preset tiny-cpu --port 8003 --kv-events-endpoint 'tcp://*:5557' \\
            --kv-events-replay-endpoint 'tcp://*:5558'
  tidal sim --list-presets
  tidal sim calibrate --json

\b
Fault and quality injection (for canary and health tests):
  --error-rate P      answer that fraction of requests with HTTP 500 before any output.
  --answer-key FILE   JSONL lines {"prompt": ..., "answer": ...}; a request whose last user
                      message (chat) or prompt (completions) matches a prompt gets that answer
  --accuracy P        with probability P (deterministic per prompt and seed), a wrong answer
                      otherwise. Timing and token counts still follow the cost model.

Times in /metrics are model seconds (wall seconds times --time-scale). LoRA adapters loaded
with /v1/load_lora_adapter occupy up to --max-loras slots; their lora_path is recorded, never
read. KV-cache events (--kv-events-endpoint, or vLLM's --kv-events-config JSON) are published as
vLLM publishes them: ZMQ PUB with a replay ROUTER, msgpack batches of BlockStored/BlockRemoved/
AllBlocksCleared, block hashes in vLLM's scheme (--prefix-caching-hash-algo, seeded from
PYTHONHASHSEED as vLLM). VLLM_SERVER_DEV_MODE=1 adds POST /reset_prefix_cache. A request that sets max_tokens gets exactly that many tokens (unless --natural-stop-always);
one without max_tokens ends, like a real model, after a log-normal number of tokens around
--output-len-median (finish_reason "stop") instead of running to the context length."""


@click.group(invoke_without_command=True, help=_HELP, context_settings={"max_content_width": 100})
@click.option("--preset", default=None, help="Replica preset (see --list-presets).")
@click.option("--list-presets", is_flag=True, help="Print the preset names, one a line, and exit.")
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 in containers)."
)
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on."
)
@click.option(
    "--served-model-name",
    "served_model_names",
    multiple=True,
    help="Model name(s) clients use (default: the preset name).",
)
@click.option(
    "--time-scale",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.001, max=1000.0),
    help="Run the model this many times faster than real time.",
)
@click.option(
    "--max-num-seqs", type=click.IntRange(1, 65536), default=None, help="Most requests running at once."
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(1, 1 << 20),
    default=None,
    help="Token budget of one step.",
)
@click.option("--max-model-len", type=click.IntRange(2, 1 << 24), default=None, help="Context length.")
@click.option("--max-loras", type=click.IntRange(0, 256), default=None, help="LoRA slots (0 disables LoRA).")
@click.option(
    "--num-gpu-blocks-override",
    type=click.IntRange(2, 1 << 26),
    default=None,
    help="KV blocks (default: from memory).",
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(["priority", "fcfs"]),
    default="priority",
    show_default=True,
    help="priority: a smaller request `priority` runs sooner and is preempted last.",
)
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    show_default=True,
    help="Prefix caching.",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the generated text.")
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A model directory with tokenizer.json (and a chat template) to count tokens exactly.",
)
@click.option(
    "--runtime-lora/--no-runtime-lora",
    default=True,
    show_default=True,
    help="Register /v1/load_lora_adapter and /v1/unload_lora_adapter.",
)
@click.option(
    "--error-rate",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="Fraction answered 500.",
)
@click.option(
    "--answer-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="JSONL of reference answers.",
)
@click.option(
    "--accuracy",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="Chance of the right answer.",
)
@click.option(
    "--output-len-median",
    default=256,
    show_default=True,
    type=click.IntRange(0, 1 << 20),
    help="Median natural answer length (log-normal) of requests without max_tokens; 0: none.",
)
@click.option(
    "--natural-stop-always",
    is_flag=True,
    help="Also end requests that set max_tokens at their natural length (unless ignore_eos).",
)
@click.option(
    "--max-num-queued-reqs",
    default=4096,
    show_default=True,
    type=click.IntRange(1, 1 << 20),
    help="Waiting requests beyond this get 503.",
)
@click.option(
    "--api-key", default=None, envvar="VLLM_API_KEY", help="Require `Authorization: Bearer KEY` on /v1."
)
@click.option(
    "--kv-events-config",
    default=None,
    help="vLLM's KV events config as JSON (enable_kv_cache_events, endpoint, replay_endpoint, topic, ...).",
)
@click.option(
    "--kv-events-endpoint",
    default=None,
    help="Publish KV events on this ZMQ address (tcp://*:PORT binds; shorthand for --kv-events-config).",
)
@click.option("--kv-events-replay-endpoint", default=None, help="ZMQ address of the KV-event replay socket.")
@click.option("--kv-events-topic", default="", show_default=True, help="Topic of the KV events.")
@click.option(
    "--prefix-caching-hash-algo",
    type=click.Choice(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
    default="sha256",
    show_default=True,
    help="Block hash algorithm (vLLM's flag): what KV events name blocks by.",
)
@click.pass_context
def sim(
    ctx: click.Context,
    preset: str | None,
    list_presets: bool,
    host: str,
    port: int,
    served_model_names: tuple[str, ...],
    time_scale: float,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    max_model_len: int | None,
    max_loras: int | None,
    num_gpu_blocks_override: int | None,
    scheduling_policy: str,
    enable_prefix_caching: bool,
    seed: int,
    tokenizer: Path | None,
    runtime_lora: bool,
    error_rate: float,
    answer_key: Path | None,
    accuracy: float,
    output_len_median: int,
    natural_stop_always: bool,
    max_num_queued_reqs: int,
    api_key: str | None,
    kv_events_config: str | None,
    kv_events_endpoint: str | None,
    kv_events_replay_endpoint: str | None,
    kv_events_topic: str,
    prefix_caching_hash_algo: str,
) -> None:
    from tidal.replicas.sim.presets import PRESETS

    if list_presets:
        for name in PRESETS:
            click.echo(name)
        return
    if ctx.invoked_subcommand is not None:
        return
    if preset is None:
        raise click.UsageError("--preset is required (see --list-presets)")
    if preset not in PRESETS:
        raise click.BadParameter(
            f"unknown preset {preset!r} (known: {', '.join(PRESETS)})", param_hint="--preset"
        )
    import os

    from tidal.replicas.sim.server import ServerConfig, serve
    from tidal.replicas.wire.kv_events import KVEventsConfig

    try:
        if kv_events_config is not None and (kv_events_endpoint or kv_events_replay_endpoint):
            raise ValueError("give --kv-events-config or --kv-events-endpoint, not both")
        kv: KVEventsConfig | None = None
        if kv_events_config is not None:
            kv = KVEventsConfig.from_json(kv_events_config)
        elif kv_events_endpoint is not None:
            kv = KVEventsConfig.from_json(
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": kv_events_endpoint,
                        "replay_endpoint": kv_events_replay_endpoint,
                        "topic": kv_events_topic,
                    }
                )
            )
        elif kv_events_replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        config = ServerConfig(
            preset=preset,
            served_model_names=list(served_model_names),
            seed=seed,
            time_scale=time_scale,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            max_loras=max_loras,
            num_gpu_blocks=num_gpu_blocks_override,
            scheduling_policy=scheduling_policy,
            enable_prefix_caching=enable_prefix_caching,
            tokenizer=str(tokenizer) if tokenizer else None,
            runtime_lora=runtime_lora,
            error_rate=error_rate,
            answer_key=str(answer_key) if answer_key else None,
            accuracy=accuracy,
            output_len_median=output_len_median,
            natural_stop_always=natural_stop_always,
            max_num_queued_reqs=max_num_queued_reqs,
            api_key=api_key,
            kv_events=kv,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
            dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"),
        )
        level = logging.getLogger().getEffectiveLevel()
        serve(config, host=host, port=port, log_level="info" if level <= logging.INFO else "warning")
    except ValueError as exc:
        click.echo(f"tidal sim: {exc}", err=True)
        sys.exit(2)


@sim.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON list of {point, published, simulated, error_pct}."
)
def calibrate(as_json: bool) -> None:
    """Compare the cost model with every published vLLM measurement it is calibrated against.

    For each point (vLLM's nightly CI latency and throughput tests on H100/H200, NVIDIA NIM's
    Llama-70B FP8 concurrency curve, Lambda's 70B-FP8 TP4/TP8 runs) it prints the published
    value, the simulator's value and the error. Points outside 15% are marked and explained.

    Example: tidal sim calibrate --json
    """
    from tidal.replicas.sim.calibrate import run_calibration

    rows = run_calibration()
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    width = max(len(r.point) for r in rows)
    click.echo(f"{'point':<{width}}  {'published':>10}  {'simulated':>10}  {'error':>7}")
    for r in rows:
        mark = "" if abs(r.error_pct) <= 15 else f"  <- {r.note or 'outside 15%'}"
        click.echo(
            f"{r.point:<{width}}  {r.published:>10.4g}  {r.simulated:>10.4g}  {r.error_pct:>+6.1f}%{mark}"
        )
    inside = sum(1 for r in rows if abs(r.error_pct) <= 15)
    click.echo(f"\n{inside}/{len(rows)} points within 15% of the published figure.")
