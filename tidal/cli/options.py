"""What several commands share: the ``--config`` option and loading the fleet it names."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from tidal.fleet import FleetConfig
    from tidal.settings import Settings

__all__ = ["fleet_config_option", "load_fleet_or_exit"]

fleet_config_option = click.option(
    "--config",
    "config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Fleet config (default: TIDAL_FLEET_CONFIG, else the embedded one).",
)


def load_fleet_or_exit(config: Path | None, settings: Settings) -> tuple[Path, FleetConfig]:
    """The fleet at ``--config``, else ``TIDAL_FLEET_CONFIG``, else the embedded one, with its
    path; a config that does not load is printed and the command exits with status 1."""
    from tidal.defaults import DEFAULT_FLEET_PATH
    from tidal.fleet import FleetConfigError, load_fleet

    path = config or settings.fleet_config or DEFAULT_FLEET_PATH
    try:
        return path, load_fleet(path)
    except FleetConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
