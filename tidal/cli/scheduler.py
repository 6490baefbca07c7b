"""``tidal scheduler``: the control plane -- batch gate, health prober, autoscaler, canary.

The assembly lives in :mod:`scheduler.service`; this module only turns options into a
:class:`~scheduler.service.SchedulerService` and runs it until SIGINT or SIGTERM.

Example::

    TIDAL_ADMIN_KEY=... tidal scheduler --config fleet.yaml --gateway http://127.0.0.1:8000 --metrics-port 9100
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from tidal.cli.options import fleet_config_option, load_fleet_or_exit

if TYPE_CHECKING:
    from tidal.fleet import FleetConfig
    from tidal.scheduler.service import SchedulerOptions
    from tidal.settings import Settings

__all__ = ["scheduler"]


@click.command()
@fleet_config_option
@click.option(
    "--gateway",
    "gateways",
    multiple=True,
    default=("http://127.0.0.1:8000",),
    show_default=True,
    help="Base URL of a gateway whose /admin API to use (repeat for several gateways).",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address of /metrics.")
@click.option(
    "--metrics-port",
    default=None,
    type=click.IntRange(1, 65535),
    help="Serve the scheduler's Prometheus /metrics on this port (default: not served).",
)
@click.option("--gate/--no-gate", default=True, show_default=True, help="Run the batch gate of shared pools.")
@click.option("--health/--no-health", default=True, show_default=True, help="Run the health prober.")
@click.option(
    "--autoscale/--no-autoscale",
    default=True,
    show_default=True,
    help="Run the autoscaler of pools with an `autoscale` section.",
)
@click.option(
    "--canary/--no-canary",
    default=True,
    show_default=True,
    help="Roll out pools whose replicas include a group other than `stable`.",
)
@click.option(
    "--actuator",
    type=click.Choice(["auto", "gauge", "local", "kubernetes"]),
    default="auto",
    show_default=True,
    help="How autoscaled pools change size; auto: kubernetes with a `kubernetes` block, local with a "
    "replica `launch` block, else only the desired-replicas gauge.",
)
@click.option(
    "--probe-period",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.05, 3600),
    help="Seconds between health probes of each replica.",
)
@click.option(
    "--probe-timeout",
    default=1.5,
    show_default=True,
    type=click.FloatRange(0.01, 3600),
    help="A probe not answered within this many seconds fails (must be below the period).",
)
@click.option(
    "--recover-after",
    default=3,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Consecutive successful probes before a replica returns to routing.",
)
@click.option(
    "--replace-after",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0, 86400),
    help="Seconds a replica may stay unhealthy before its actuator replaces it.",
)
def scheduler(
    config: Path | None,
    gateways: tuple[str, ...],
    metrics_host: str,
    metrics_port: int | None,
    gate: bool,
    health: bool,
    autoscale: bool,
    canary: bool,
    actuator: str,
    probe_period: float,
    probe_timeout: float,
    recover_after: int,
    replace_after: float,
) -> None:
    """Run the control plane against the gateway's /admin API (admin key: TIDAL_ADMIN_KEY):
    the batch gate pauses the shared worker lane while a shared pool's users need its replicas,
    the health prober takes failing replicas out of routing, the autoscaler sizes autoscaled
    pools, the canary controller rolls a new replica group forward or back. SIGINT/SIGTERM stop
    it cleanly (the shared lane is left paused for the next scheduler).

    Example: TIDAL_ADMIN_KEY=... tidal scheduler --config fleet.yaml --gateway http://127.0.0.1:8000
    --metrics-port 9100
    """
    import asyncio

    from pydantic import ValidationError

    from tidal.scheduler.service import SchedulerOptions, SchedulerSetupError
    from tidal.settings import get_settings

    try:
        settings = get_settings()
    except ValidationError as exc:
        _fail(f"settings: {exc}")
    path, fleet = load_fleet_or_exit(config, settings)
    if not settings.admin_key:
        _fail("TIDAL_ADMIN_KEY is not set: the scheduler calls the gateway's /admin API with it")
    try:
        options = SchedulerOptions(
            gate=gate,
            health=health,
            autoscale=autoscale,
            canary=canary,
            actuator=actuator,  # type: ignore[arg-type]  # click.Choice checked it
            probe_period_s=probe_period,
            probe_timeout_s=probe_timeout,
            recover_after=recover_after,
            replace_after_s=replace_after,
            local_log_dir=settings.data_dir / "logs" / "autoscaler",
        )
        asyncio.run(_run(fleet, settings, options, list(gateways), metrics_host, metrics_port, str(path)))
    except (SchedulerSetupError, ValueError, OSError) as exc:
        _fail(str(exc))


def _fail(message: str) -> NoReturn:
    click.echo(f"tidal scheduler: {message}", err=True)
    sys.exit(2)


async def _run(
    fleet: FleetConfig,
    settings: Settings,
    options: SchedulerOptions,
    gateways: list[str],
    metrics_host: str,
    metrics_port: int | None,
    source: str,
) -> None:
    import asyncio
    import signal

    from tidal.clock import SystemClock
    from tidal.scheduler.gateway import GatewayAdmin
    from tidal.scheduler.service import SchedulerService

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with GatewayAdmin(gateways, admin_key=settings.admin_key) as gateway:
        service = SchedulerService(fleet, settings, gateway=gateway, clock=SystemClock(), options=options)
        try:
            if metrics_port is not None:
                service.serve_metrics(metrics_host, metrics_port)
        except OSError:
            await service.aclose()
            raise
        click.echo(f"scheduler for fleet {source}, gateway(s) {', '.join(gateways)}")
        for line in service.describe():
            click.echo(f"  {line}")
        if metrics_port is not None:
            click.echo(f"  metrics on http://{metrics_host}:{metrics_port}/metrics")
        sys.stdout.flush()
        await service.run(stop)
    click.echo("scheduler stopped")
