"""``tidal up``: the whole platform on this machine, on embedded defaults.

Every part runs as its own process, as it would in production (see ``docker-compose.yml``):
the replicas the fleet config asks to launch, the gateway, the batch workers, the scheduler and
Flower. ``tidal up`` starts them, prints where each listens, and stops them all on Ctrl-C.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from tidal.fleet import FleetConfig, KVEventsSpec, LaunchSpec, PoolSpec, ReplicaSpec

__all__ = ["Part", "autoscaler_lines", "batch_broker_env", "plan_parts", "up"]

_PLANNED = re.compile(
    r'^tidal_autoscaler_planned_capacity_requests_per_second\{pool="([^"]+)"\} (\S+)$', re.M
)


@dataclass
class Part:
    """One process of the platform: the ``tidal`` subcommand that runs it and how to check it."""

    name: str
    command: str  # the tidal subcommand, e.g. "gateway"
    args: list[str]
    port: int | None = None
    health_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    describe: str = ""

    @property
    def url(self) -> str | None:
        return f"http://127.0.0.1:{self.port}" if self.port else None


def _available(command: str) -> bool:
    from tidal.cli import LazyGroup

    return LazyGroup._load(command) is not None


def batch_broker_env(data_dir: Path) -> tuple[dict[str, str], str | None]:
    """The batch tier's broker for ``tidal up``: RabbitMQ when reachable, else an embedded one.

    Returns the environment for every part and, for the fallback, what it costs.
    """
    import socket
    import urllib.parse

    from tidal.settings import get_settings

    url = get_settings().broker_url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("amqp", "pyamqp", "amqps"):
        return {"TIDAL_BROKER_URL": url}, None
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=1.0):
            return {"TIDAL_BROKER_URL": url}, None
    except OSError:
        pass
    env = {"TIDAL_BROKER_URL": "filesystem://", "TIDAL_BROKER_DIR": str(data_dir / "broker")}
    note = (
        f"RabbitMQ is not reachable at {parts.hostname}:{parts.port or 5672}; the batch tier uses an embedded "
        "broker (kombu filesystem:// under the data dir) instead. Batches still complete, but it loses: "
        "message priorities (batches run in arrival order), remote control (the scheduler cannot pause "
        "the shared lane through Celery; workers still follow the persisted lane state), and Flower "
        "(not started). Start RabbitMQ on 127.0.0.1:5672 for the full tier."
    )
    return env, note


def autoscaler_lines(fleet: FleetConfig, scheduler_metrics: str) -> dict[str, str]:
    """What ``tidal up`` says about each autoscaled pool whose capacity the scheduler's metrics
    (``tidal_autoscaler_planned_capacity_requests_per_second``) already give."""
    planned = {m.group(1): float(m.group(2)) for m in _PLANNED.finditer(scheduler_metrics)}
    lines: dict[str, str] = {}
    for pool in fleet.pools.values():
        spec = pool.autoscale
        if spec is None or pool.name not in planned:
            continue
        rps = planned[pool.name]
        if spec.capacity_from == "plan":
            plan = spec.planned
            cls = fleet.classes.get("interactive")
            ttft = plan.ttft_p95_s or (cls.ttft_slo_s if cls else 1.0)
            tpot = plan.tpot_p95_s or (cls.tpot_slo_s if cls else 0.05)
            how = (
                f"from {plan.file}"
                if plan.file
                else f"measured on the simulated replica ({plan.preset or pool.sim_preset}, virtual time) "
                f"at TTFT p95 <= {ttft:g} s, TPOT p95 <= {tpot * 1000:g} ms"
            )
            capacity = f"planned capacity {rps:.1f} requests/s per replica, {how}"
        else:
            capacity = f"capacity {rps:g} requests/s per replica (capacity_rps_per_replica)"
        lines[pool.name] = (
            f"autoscaler: running on pool {pool.name} ({spec.min_replicas}-{spec.max_replicas} replicas, "
            f"policy {spec.policy}); {capacity}"
        )
    return lines


def _scheduler_metrics(port: int) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1.0) as resp:
            body: bytes = resp.read()
            return body.decode()
    except OSError:
        return ""


def kv_events_args(kind: str, spec: KVEventsSpec | None) -> list[str]:
    """The flags that make a launched replica publish where the fleet says it does: the same
    ports, bound on every interface (vLLM binds its PUB socket only on a wildcard address)."""
    if spec is None:
        return ["--no-kv-events"] if kind == "vllm" else []

    def bind(endpoint: str) -> str:
        return re.sub(r"^tcp://[^/]+:(\d+)$", r"tcp://*:\1", endpoint)

    pub = bind(spec.endpoint)
    replay = bind(spec.replay_endpoint) if spec.replay_endpoint else None
    if kind == "sim":
        out = ["--kv-events-endpoint", pub, "--kv-events-topic", spec.topic]
        return out + (["--kv-events-replay-endpoint", replay] if replay else [])
    import json

    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub,
        "replay_endpoint": replay,
        "topic": spec.topic,
    }
    # `tidal replica vllm` passes unknown flags to vLLM unchanged: its own config, verbatim.
    return ["--no-kv-events", "--kv-events-config", json.dumps(config)]


def _describe(pool: PoolSpec, replica: ReplicaSpec) -> str:
    assert replica.launch is not None
    what = f"simulated replica ({replica.launch.preset})" if replica.launch.kind == "sim" else "vLLM replica"
    extra = f", group {replica.group} at weight {replica.weight:g}" if replica.group != "stable" else ""
    return f"{what}, pool {pool.name} ({pool.kind}){extra}"


def plan_parts(
    fleet_path: Path,
    *,
    port: int,
    api_key: str,
    data_dir: Path,
    admin_key: str | None = None,
    scheduler_port: int = 9100,
    worker_metrics_port: int = 9101,
) -> list[Part]:
    """The processes ``tidal up`` runs for a fleet, in start order. The gateway and the scheduler
    share ``admin_key`` (``TIDAL_ADMIN_KEY``; generated when not given), which the scheduler uses
    on the gateway's ``/admin`` API; the scheduler serves its metrics on ``scheduler_port``, the
    worker on ``worker_metrics_port``."""
    from tidal.fleet import load_fleet

    fleet = load_fleet(fleet_path)
    parts: list[Part] = []
    launched: list[tuple[str, LaunchSpec, int, str, KVEventsSpec | None, str]] = [
        (r.name, r.launch, r.url.port or 80, pool.model, r.kv_events, _describe(pool, r))
        for pool, r in fleet.all_replicas()
        if r.launch is not None
    ]
    provider = fleet.external_provider
    if provider is not None and provider.launch is not None:
        model = provider.model or next((m.name for m in fleet.models if not m.embedding), "")
        what = "stand-in for the external provider (overflow)"
        launched.append(("external", provider.launch, provider.url.port or 80, model, None, what))
    for name, launch, rport, model, kv_events, describe in launched:
        if launch.kind == "sim":
            args = ["--preset", launch.preset or "", "--port", str(rport), "--served-model-name", model]
            args += kv_events_args("sim", kv_events)
            parts.append(Part(name, "sim", args + launch.extra_args(), rport, describe=describe))
        else:
            args = ["--model", launch.model_dir or "", "--port", str(rport), "--served-model-name", model]
            argv = ["vllm", *args, *kv_events_args("vllm", kv_events), *launch.extra_args()]
            parts.append(Part(name, "replica", argv, rport, describe=describe))
    common_env = {"TIDAL_DATA_DIR": str(data_dir), "TIDAL_DEV_API_KEY": api_key}
    admin_env = {**common_env, "TIDAL_ADMIN_KEY": admin_key or f"tidal-admin-{secrets.token_urlsafe(24)}"}
    parts.append(
        Part(
            "gateway",
            "gateway",
            ["--config", str(fleet_path), "--port", str(port)],
            port,
            health_path="/healthz",
            env=admin_env,
            describe="OpenAI-compatible API: chat, completions, embeddings, files, batches",
        )
    )
    parts.append(
        Part(
            "worker",
            "worker",
            ["--config", str(fleet_path), "--lane", "all", "--metrics-port", str(worker_metrics_port)],
            worker_metrics_port,
            health_path="/metrics",
            env=common_env,
            describe="batch worker (lanes reserved, spot, shared); /metrics here",
        )
    )
    parts.append(
        Part(
            "scheduler",
            "scheduler",
            [
                "--config",
                str(fleet_path),
                "--gateway",
                f"http://127.0.0.1:{port}",
                "--metrics-port",
                str(scheduler_port),
            ],
            scheduler_port,
            health_path="/metrics",
            env=admin_env,
            describe=f"batch gate, health prober, autoscaler, canary; metrics at "
            f"http://127.0.0.1:{scheduler_port}/metrics",
        )
    )
    parts.append(
        Part(
            "flower",
            "flower",
            ["--port", "5555"],
            5555,
            health_path="/healthcheck",
            env=common_env,
            describe="Flower UI for the batch tier (basic auth)",
        )
    )
    return parts


@click.command()
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port of the gateway (the OpenAI-compatible API).",
)
@click.option(
    "--api-key", default=None, help="API key of the development tenant (default: generated and printed)."
)
@click.option(
    "--config",
    "config",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Fleet config (default: the embedded one, see `tidal fleet default`).",
)
@click.option(
    "--data-dir",
    default=Path(".tidal"),
    show_default=True,
    type=click.Path(path_type=Path),
    help="Where the SQLite store, uploaded files and logs go.",
)
@click.option(
    "--flower-port",
    default=5555,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port of Flower, the batch tier's UI.",
)
@click.option(
    "--scheduler-port",
    default=9100,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port of the scheduler's Prometheus /metrics.",
)
@click.option(
    "--worker-metrics-port",
    default=9101,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port of the batch worker's Prometheus /metrics.",
)
@click.option(
    "--ready-timeout",
    default=240.0,
    show_default=True,
    type=float,
    help="Seconds to wait for each part to become healthy.",
)
def up(
    port: int,
    api_key: str | None,
    config: Path | None,
    data_dir: Path,
    flower_port: int,
    scheduler_port: int,
    worker_metrics_port: int,
    ready_timeout: float,
) -> None:
    """Run the whole platform locally on embedded defaults: simulated replicas, gateway, batch
    workers, scheduler and Flower. Prints where each part listens; Ctrl-C stops everything.

    Example: tidal up --port 8000 --api-key dev-key
    """
    from tidal.defaults import DEFAULT_FLEET_PATH
    from tidal.fleet import load_fleet
    from tidal.replicas.launcher import ReplicaProcess, ReplicaStartError
    from tidal.settings import get_settings

    fleet_path = (config or DEFAULT_FLEET_PATH).resolve()
    key = api_key or f"tidal-dev-{secrets.token_urlsafe(24)}"
    admin_key = os.environ.get("TIDAL_ADMIN_KEY") or f"tidal-admin-{secrets.token_urlsafe(24)}"
    data_dir.mkdir(parents=True, exist_ok=True)
    logs = data_dir / "logs"
    parts = plan_parts(
        fleet_path,
        port=port,
        api_key=key,
        data_dir=data_dir.resolve(),
        admin_key=admin_key,
        scheduler_port=scheduler_port,
        worker_metrics_port=worker_metrics_port,
    )
    broker_env, broker_note = batch_broker_env(data_dir.resolve())
    for part in parts:
        part.env.update(broker_env)
        if part.command == "flower":
            part.args = ["--port", str(flower_port)]
            part.port = flower_port
    if broker_note:
        click.echo(f"tidal up: {broker_note}")
        parts = [p for p in parts if p.command != "flower"]

    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)

    running: list[tuple[Part, ReplicaProcess]] = []
    missing: list[Part] = []
    click.echo(f"tidal up: fleet {fleet_path}, data in {data_dir}/, logs in {logs}/")
    try:
        for part in parts:
            if stop.is_set():
                break
            if not _available(part.command):
                missing.append(part)
                continue
            argv = [sys.executable, "-m", "tidal", part.command, *part.args]
            proc = ReplicaProcess(
                part.name,
                argv,
                port=part.port or 0,
                env={**os.environ, **part.env},
                log_path=logs / f"{part.name}.log",
                health_path=part.health_path,
            )
            proc.start()
            running.append((part, proc))
        for part, proc in running:
            if stop.is_set():
                break
            if part.port:
                proc.wait_ready(ready_timeout)
            elif not proc.running():
                raise ReplicaStartError(f"{part.name} exited at start:\n{proc.log_tail()}")
        if not stop.is_set():
            _print_summary(running, missing, key, port, admin_key, get_settings().flower_basic_auth)
        scheduler = next((p for p, _ in running if p.command == "scheduler"), None)
        fleet = load_fleet(fleet_path)
        # The scheduler plans capacities in the background (seconds, on a first start): say what
        # it runs on as soon as its metrics tell.
        untold = {p.name for p in fleet.pools.values() if p.autoscale} if scheduler else set()
        planning_said = False
        while not stop.is_set():
            if untold and scheduler is not None and scheduler.port:
                told = autoscaler_lines(fleet, _scheduler_metrics(scheduler.port))
                for pool in sorted(untold & told.keys()):
                    click.echo(told[pool])
                    untold.discard(pool)
                if untold and not planning_said:
                    click.echo(f"autoscaler: planning the capacity of {', '.join(sorted(untold))} ...")
                    planning_said = True
                sys.stdout.flush()
            for part, proc in running:
                if not proc.running():
                    click.echo(
                        f"\n{part.name} stopped unexpectedly; its log ends with:\n{proc.log_tail(20)}",
                        err=True,
                    )
                    stop.set()
            stop.wait(1.0)
    except ReplicaStartError as exc:
        click.echo(f"\nstart-up failed: {exc}", err=True)
        stop.set()
    finally:
        click.echo("\nstopping ...")
        for part, proc in reversed(running):
            proc.stop()
            click.echo(f"  {part.name} stopped")
        click.echo("bye")


def _print_summary(
    running: Sequence[tuple[Part, object]],
    missing: list[Part],
    key: str,
    port: int,
    admin_key: str,
    flower_auth: str = "",
) -> None:
    click.echo("")
    width = max((len(p.name) for p, _ in running), default=8)
    for part, _ in running:
        where = part.url or "(no port)"
        click.echo(f"  {part.name:<{width}}  {where:<24}  {part.describe}")
    for part in missing:
        click.echo(f"  {part.name:<{width}}  {'not available yet':<24}  {part.describe}")
    if any(p.command == "gateway" for p, _ in running):
        click.echo(f"\nOpenAI base URL: http://127.0.0.1:{port}/v1   API key: {key}")
        click.echo(f"Admin API: http://127.0.0.1:{port}/admin   admin key: {admin_key}")
    flower = next((p for p, _ in running if p.command == "flower"), None)
    if flower is not None and flower_auth:
        user, _, password = flower_auth.partition(":")
        click.echo(f"Flower: {flower.url}   login: {user} / {password} (TIDAL_FLOWER_BASIC_AUTH)")
    scraped = [
        f"{p.url}/metrics" for p, _ in running if p.command in ("gateway", "scheduler", "worker") and p.url
    ]
    if scraped:
        click.echo(f"Prometheus metrics: {', '.join(scraped)}; Grafana dashboard and alert rules in deploy/")
    click.echo("Watch the platform work: `tidal demo --quick` (its own copy on free ports; an HTML report)")
    click.echo("Ready. Ctrl-C stops everything.")
    sys.stdout.flush()
    time.sleep(0)
