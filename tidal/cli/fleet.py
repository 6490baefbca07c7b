"""``tidal fleet``: inspect and validate fleet configs."""

from __future__ import annotations

import sys
from pathlib import Path

import click

__all__ = ["fleet"]


@click.group()
def fleet() -> None:
    """Fleet config tools."""


@fleet.command("check")
@click.argument("path", type=click.Path(path_type=Path))
def check(path: Path) -> None:
    """Validate a fleet config strictly and summarise it; exit 1 naming every bad key.

    Example: tidal fleet check examples/fleet.yaml
    """
    from tidal.fleet import FleetConfigError, load_fleet
    from tidal.router.loader import check_router

    try:
        cfg = load_fleet(path)
    except FleetConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    router_problems = check_router(cfg.router)
    if router_problems:
        lines = "\n".join(f"  {p}" for p in router_problems)
        click.echo(f"fleet config {path} is invalid:\n{lines}", err=True)
        sys.exit(1)
    for pool in cfg.pools.values():
        shared = " shared" if pool.shared else ""
        region = f", region {pool.region}" if pool.region else ""
        click.echo(
            f"pool {pool.name} ({pool.kind}{shared}, model {pool.model}{region}): "
            f"{len(pool.replicas)} replicas"
        )
        for r in pool.replicas:
            click.echo(f"  {r.name} {r.base_url} group={r.group} weight={r.weight:g}")
    click.echo(f"features: {', '.join(sorted(cfg.features))}")
    click.echo(f"router default profile: {cfg.router.default_profile or 'tidal'}")
    click.echo("ok")


@fleet.command("default")
def default() -> None:
    """Print the embedded default fleet config (the one `tidal up` uses)."""
    from tidal.defaults import DEFAULT_FLEET_PATH

    click.echo(DEFAULT_FLEET_PATH.read_text(), nl=False)
