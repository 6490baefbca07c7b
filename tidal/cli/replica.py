"""``tidal replica``: build the tiny test model and run real vLLM replicas."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click

__all__ = ["replica"]


@click.group()
def replica() -> None:
    """Real vLLM replicas for development and tests (needs the `vllm` extra)."""


@replica.command("tiny-model")
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write model/ and adapters/ into.",
)
@click.option(
    "--adapters",
    default=0,
    show_default=True,
    type=click.IntRange(0, 64),
    help="How many random LoRA adapters to build.",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for the random weights.")
def tiny_model(out: Path, adapters: int, seed: int) -> None:
    """Build a tiny random-weight Llama, a byte-level BPE tokenizer with a chat template, and
    N LoRA adapters, all offline.

    Example: tidal replica tiny-model --out /tmp/tiny --adapters 2
    """
    from tidal.replicas.tiny_model import TinyModelSpec, adapter_dirs, build_tiny_model

    model_dir = build_tiny_model(out, adapters=adapters, spec=TinyModelSpec(seed=seed))
    click.echo(f"model: {model_dir}")
    for a in adapter_dirs(out)[:adapters]:
        click.echo(f"adapter: {a}")


@replica.command("vllm", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Model directory (e.g. from `tidal replica tiny-model`).",
)
@click.option("--port", required=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--served-model-name", default="tiny", show_default=True, help="Model name clients use.")
@click.option(
    "--kv-cache-gib",
    default=1,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on the CPU.",
)
@click.option(
    "--max-loras",
    default=2,
    show_default=True,
    type=click.IntRange(0, 64),
    help="LoRA slots (0 disables LoRA).",
)
@click.option("--max-model-len", default=4096, show_default=True, type=int, help="Context length.")
@click.option("--timeout", default=240.0, show_default=True, type=float, help="Seconds to wait for /health.")
@click.option(
    "--kv-events/--no-kv-events",
    default=True,
    show_default=True,
    help="Publish KV-cache events (vLLM's --kv-events-config) for the gateways' exact KV index.",
)
@click.option(
    "--kv-events-port",
    default=0,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port of the events' PUB socket, bound on every interface (0: a free one).",
)
@click.option(
    "--kv-events-replay-port",
    default=0,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port of the replay socket, bound on --host (0: a free one).",
)
@click.option("--kv-events-topic", default="", show_default=True, help="Topic of the KV events.")
@click.pass_context
def vllm(
    ctx: click.Context,
    model_dir: str,
    port: int,
    host: str,
    served_model_name: str,
    kv_cache_gib: int,
    max_loras: int,
    max_model_len: int,
    timeout: float,
    kv_events: bool,
    kv_events_port: int,
    kv_events_replay_port: int,
    kv_events_topic: str,
) -> None:
    """Start a real vLLM OpenAI server and wait until /health answers.

    Runs `python -m vllm.entrypoints.openai.api_server` with `--scheduling-policy priority`,
    `--enable-lora`, runtime LoRA loading and KV-cache events enabled (ZMQ PUB on
    tcp://*:--kv-events-port, replay on --kv-events-replay-port; the events carry prompt token
    ids, keep those ports private). Extra arguments go to vLLM unchanged.

    Example: tidal replica vllm --model /tmp/tiny/model --port 8001 --kv-events-port 5557 --max-num-seqs 64
    """
    from tidal.replicas.launcher import ReplicaStartError, kv_events_config, vllm_process

    proc = vllm_process(
        model_dir,
        port=port,
        host=host,
        served_model_name=served_model_name,
        kv_cache_gib=kv_cache_gib,
        max_loras=max_loras,
        max_model_len=max_model_len,
        extra_args=list(ctx.args),
        kv_events=kv_events_config(
            kv_events_port or None, kv_events_replay_port or None, topic=kv_events_topic, host=host
        )
        if kv_events
        else False,
    )
    proc.start()
    click.echo(f"starting vLLM on {proc.url} (log: {proc.log_path})")
    if proc.kv_events is not None:
        pub, replay = proc.kv_events_addresses()
        click.echo(f"KV events on {pub} (replay {replay}, topic {kv_events_topic!r})")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        proc.wait_ready(timeout)
        click.echo(f"vLLM ready on {proc.url}  model={served_model_name}  (Ctrl-C stops it)")
        while not stop.is_set() and proc.running():
            stop.wait(1.0)
        if not proc.running():
            click.echo(f"vLLM exited:\n{proc.log_tail()}", err=True)
            sys.exit(1)
    except ReplicaStartError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    finally:
        proc.stop()
        click.echo("vLLM stopped")
