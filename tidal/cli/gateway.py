"""``tidal gateway``: the OpenAI-compatible gateway."""

from __future__ import annotations

import functools
import gc
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tidal.cli.options import fleet_config_option, load_fleet_or_exit
from tidal.logs import uvicorn_log_config

if TYPE_CHECKING:
    from starlette.types import ASGIApp

__all__ = ["gateway"]


def _build_app(path: str) -> ASGIApp:
    """One worker's application (``--workers N``), from the same settings and fleet file."""
    from tidal.api import create_app
    from tidal.fleet import load_fleet
    from tidal.settings import get_settings

    return create_app(load_fleet(Path(path)), get_settings())


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
    help="Gateway processes on this port (SO_REUSEPORT); more than one needs TIDAL_REDIS_URL, "
    "through which they share in-flight counts, queues and caps.",
)
def gateway(config: Path | None, host: str, port: int, workers: int) -> None:
    """Serve the OpenAI-compatible API (chat, completions, embeddings, models, files, batches,
    jobs) in front of the fleet, with /healthz, /metrics and the /admin API (TIDAL_ADMIN_KEY).

    Interactive requests are admitted (bounded queue, 429 + Retry-After, overflow to the external
    provider), routed by the fleet's router profile (default `tidal`: adapter, session and prefix
    affinity with bounded load) and streamed from capped replicas.

    With TIDAL_REDIS_URL set, every gateway process (on this host or others) shares the load it
    has on each replica, its queue and the replicas' caps through Redis; `--workers N` then runs
    N processes on one port. Without Redis one process routes on its own counts, and
    `--workers` above 1 is refused: each worker would see a fraction of the load and let every
    replica take N times its cap.

    Example: TIDAL_ADMIN_KEY=... tidal gateway --config fleet.yaml --port 8000

    Example: TIDAL_REDIS_URL=redis://127.0.0.1:6379/0 tidal gateway --workers 2
    """
    import uvicorn

    from tidal.api import create_app
    from tidal.api.protocol import RequestBounds, bounded_protocol
    from tidal.router.loader import RouterConfigError
    from tidal.settings import get_settings

    settings = get_settings()
    path, fleet = load_fleet_or_exit(config, settings)
    if workers > 1 and not settings.redis_url:
        click.echo(
            f"--workers {workers} needs shared load state: set TIDAL_REDIS_URL (e.g. "
            "redis://127.0.0.1:6379/0). Without it each worker would route on its own share of the "
            f"load and let every replica take {workers} x its cap. Use --workers 1 without Redis.",
            err=True,
        )
        sys.exit(2)
    try:
        app = create_app(fleet, settings)
    except RouterConfigError as exc:
        click.echo(f"fleet config {path}: {exc}", err=True)
        sys.exit(1)
    shared = f", load shared through Redis ({settings.redis_namespace})" if settings.redis_url else ""
    # A log line, not a print: with JSON logs every line the gateway writes is JSON.
    logging.getLogger("tidal.gateway").info(
        "gateway on http://%s:%d (fleet %s, %d process(es)%s)", host, port, path, workers, shared
    )
    g = fleet.gateway
    bounds = RequestBounds(
        max_head_bytes=g.max_head_bytes,
        head_timeout_s=g.head_timeout_s,
        body_timeout_s=g.body_timeout_s,
        body_min_bytes_per_s=g.body_min_bytes_per_s,
        send_timeout_s=g.send_timeout_s,
    )
    if workers > 1:
        from tidal.api.serve import serve_workers

        del app  # each worker builds its own
        build = functools.partial(_build_app, str(path))
        sys.exit(
            serve_workers(
                build,
                host=host,
                port=port,
                workers=workers,
                bounds=bounds,
            )
        )
    # The modules, models and app built so far live as long as the process: out of the cyclic
    # collector's sight, a full collection no longer walks them (a pause of tens to hundreds of
    # milliseconds for every stream in flight; the requests' own garbage is collected as before).
    gc.freeze()
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=bounded_protocol(bounds),
        log_level="warning",
        log_config=uvicorn_log_config(),
        access_log=False,
    )
