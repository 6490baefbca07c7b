"""``tidal flower``: Celery's Flower UI for the batch tier, behind basic auth."""

from __future__ import annotations

import sys

import click

__all__ = ["flower"]


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--port", default=5555, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on."
)
def flower(host: str, port: int) -> None:
    """Serve Flower for the batch tier: the lanes' workers (named LANE@HOST-PID), their queues
    and tasks, live. Basic auth comes from TIDAL_FLOWER_BASIC_AUTH (user:password); /healthcheck
    and /metrics are open, as in Flower itself.

    Example: TIDAL_FLOWER_BASIC_AUTH=ops:s3cret tidal flower --port 5555
    """
    from tidal.priority.queues import is_amqp
    from tidal.settings import get_settings
    from tidal.workers.app import control_app

    settings = get_settings()
    if not is_amqp(settings.broker_url):
        click.echo(
            f"tidal flower: the broker {settings.broker_url.split('://')[0]}:// has no remote control or "
            "events, so Flower would show nothing; it needs RabbitMQ (TIDAL_BROKER_URL=amqp://...)",
            err=True,
        )
        sys.exit(2)
    user, _, password = settings.flower_basic_auth.partition(":")
    if not user or not password:
        click.echo("tidal flower: TIDAL_FLOWER_BASIC_AUTH must be user:password", err=True)
        sys.exit(2)
    app = control_app(settings)
    # In-process: the password never appears on a command line another user could read.
    app.start(
        [
            "flower",
            f"--address={host}",
            f"--port={port}",
            f"--basic-auth={settings.flower_basic_auth}",
            "--purge_offline_workers=120",  # spot workers come and go
            "--max_tasks=10000",
            "--inspect_timeout=2000",
        ]
    )
