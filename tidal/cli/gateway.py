"""``tidal gateway``: the OpenAI-compatible gateway."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import click

from tidal.cli.options import fleet_config_option, load_fleet_or_exit

__all__ = ["gateway"]


@click.command()
@fleet_config_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on."
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Uvicorn worker processes (each holds its own router state).",
)
def gateway(config: Path | None, host: str, port: int, workers: int) -> None:
    """Serve the OpenAI-compatible API (chat, completions, embeddings, models, files, batches,
    jobs) in front of the fleet, with /healthz, /metrics and the /admin API (TIDAL_ADMIN_KEY).

    Interactive requests are admitted (bounded queue, 429 + Retry-After, overflow to the external
    provider), routed by the fleet's router profile (default `tidal`: adapter, session and prefix
    affinity with bounded load) and streamed from capped replicas.

    Example: TIDAL_ADMIN_KEY=... tidal gateway --config fleet.yaml --port 8000
    """
    import uvicorn

    from api import create_app
    from router.loader import RouterConfigError
    from tidal.settings import get_settings

    settings = get_settings()
    path, fleet = load_fleet_or_exit(config, settings)
    try:
        app = create_app(fleet, settings)
    except RouterConfigError as exc:
        click.echo(f"fleet config {path}: {exc}", err=True)
        sys.exit(1)
    click.echo(f"gateway on http://{host}:{port} (fleet {path})")
    # The modules, models and app built so far live as long as the process: out of the cyclic
    # collector's sight, a full collection no longer walks them (a pause of tens to hundreds of
    # milliseconds for every stream in flight; the requests' own garbage is collected as before).
    gc.freeze()
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        workers=None if workers == 1 else workers,
    )
