"""``tidal worker``: a batch worker for one lane."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from tidal.cli.options import fleet_config_option, load_fleet_or_exit

__all__ = ["worker"]


@click.command()
@click.option(
    "--lane",
    required=True,
    type=click.Choice(["reserved", "spot", "shared", "all"]),
    help="Which lane: reserved (batch pool), spot (preemptible), shared (borrowed interactive "
    "replicas), all (every queue in one light process, as `tidal up` runs it).",
)
@fleet_config_option
@click.option(
    "--concurrency",
    default=4,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Chunks run at once (each sends its lines concurrently).",
)
@click.option("--hostname", default=None, help="Celery node name (default: LANE@HOST-PID).")
@click.option(
    "--metrics-port", default=None, type=click.IntRange(1, 65535), help="Serve Prometheus /metrics here."
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address /metrics listens on (0.0.0.0 in a container, for Prometheus to scrape).",
)
def worker(
    lane: str,
    config: Path | None,
    concurrency: int,
    hostname: str | None,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Consume a lane's chunk queues and send each chunk's lines to the lane's replicas with low
    vLLM priority. SIGTERM (a spot notice) stops sending, keeps finished results and requeues
    the rest within TIDAL_SOFT_SHUTDOWN_S.

    Example: tidal worker --lane spot --config fleet.yaml --concurrency 8
    """
    import logging

    from tidal.settings import get_settings
    from tidal.workers.main import run_worker

    settings = get_settings()
    path, fleet = load_fleet_or_exit(config, settings)
    try:
        run_worker(
            settings,
            fleet,
            lane=lane,
            concurrency=concurrency,
            hostname=hostname,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            loglevel=logging.getLevelName(logging.getLogger().level),
        )
    except ValueError as exc:
        click.echo(f"tidal worker: {exc}", err=True)
        sys.exit(2)
