"""The ``tidal`` command line.

Each subcommand lives in its own module and is imported only when used, so ``tidal --help``
stays fast and a part that needs an optional extra (vLLM, Kubernetes) does not burden the rest.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import click

from tidal import __version__
from tidal.logs import FORMATS, configure

__all__ = ["main"]

# name -> "module:attribute"; one line per subcommand.
COMMANDS: dict[str, str] = {
    "up": "tidal.cli.up:up",
    "replica": "tidal.cli.replica:replica",
    "sim": "tidal.cli.sim:sim",
    "gateway": "tidal.cli.gateway:gateway",
    "worker": "tidal.cli.worker:worker",
    "flower": "tidal.cli.flower:flower",
    "batch": "tidal.cli.batch:batch",
    "jobs": "tidal.cli.jobs:jobs",
    "scheduler": "tidal.cli.scheduler:scheduler",
    "autoscale": "tidal.cli.autoscale:autoscale",
    "bench": "tidal.cli.bench:bench",
    "fleet": "tidal.cli.fleet:fleet",
    "keys": "tidal.cli.keys:keys",
    "plan": "tidal.cli.plan:plan",
    "demo": "tidal.cli.demo:demo",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use; missing modules are simply not listed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if self._load(name) is not None]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._load(cmd_name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                return None
            raise
        command = getattr(module, attr)
        assert isinstance(command, click.Command)
        return command


@click.group(
    cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, prog_name="tidal")
@click.option("--log-level", default="INFO", show_default=True, help="Python logging level for this process.")
@click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="Also log every HTTP request the command makes (httpx's INFO lines).",
)
@click.option(
    "--log-format",
    type=click.Choice(FORMATS),
    default="text",
    show_default=True,
    envvar="TIDAL_LOG_FORMAT",
    help="text, or one JSON object per line with the request id of each (env TIDAL_LOG_FORMAT).",
)
@click.option(
    "--access-log",
    is_flag=True,
    help="One log line per request (gateway, worker per batch line, simulator), on the "
    "tidal.access logger, with its request id (env TIDAL_ACCESS_LOG).",
)
def cli(log_level: str, verbose: bool, log_format: str, access_log: bool) -> None:
    """Tidal: one GPU pool for interactive chat and batch LLM work.

    Start everything on simulated replicas with `tidal up`; each part can also run on its own
    (`tidal gateway`, `tidal worker`, `tidal scheduler`, `tidal sim`, ...).
    """
    # The processes a command starts (`tidal up`'s gateway, workers, simulators) log the same way.
    os.environ["TIDAL_LOG_FORMAT"] = log_format
    if access_log:
        os.environ["TIDAL_ACCESS_LOG"] = "true"
    configure(log_level, log_format)
    # A command prints what its user asked for, not a line per HTTP request it made (a `tidal jobs`
    # poll loop would print one a second); --verbose brings them back.
    for name in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def main(argv: Any = None) -> None:
    cli.main(args=argv, prog_name="tidal")
