"""``tidal autoscale``: the autoscaler's offline tools (importing load history)."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

__all__ = ["autoscale"]

_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


@click.group()
def autoscale() -> None:
    """The autoscaler's offline tools.

    Example: tidal autoscale import-profile requests.csv --pool interactive
    """


@autoscale.command("import-profile")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--pool", default="interactive", show_default=True, help="The pool whose profile it becomes.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "timestamps", "rates", "prometheus"]),
    default="auto",
    show_default=True,
    help="timestamps: a CSV of request times; rates: a CSV of time,rps (or time,requests); "
    "prometheus: the JSON of /api/v1/query_range.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The scheduler's data dir (default: TIDAL_DATA_DIR, else .tidal).",
)
@click.option(
    "--utc-offset",
    type=click.FloatRange(-14, 14),
    default=0.0,
    show_default=True,
    help="Hours from UTC of the users' local time (the hour of week is theirs).",
)
@click.option("--dry-run", is_flag=True, help="Print what was learned; write nothing.")
def import_profile(
    file: Path, pool: str, fmt: str, data_dir: Path | None, utc_offset: float, dry_run: bool
) -> None:
    """Learn a pool's hour-of-week load profile from FILE and save it where the scheduler reads it.

    FILE is history of the pool's requests: a CSV of request timestamps (Unix seconds or ISO
    8601), a CSV of per-minute rates (time,rps or time,requests), or a Prometheus range-query
    export (the JSON of /api/v1/query_range of a requests-per-second query). The profile
    replaces the pool's in <data dir>/scheduler/autoscaler-profiles.json; a running scheduler
    takes it at its next save (within 5 minutes), a stopped one at start.

    Example: tidal autoscale import-profile requests.csv --pool interactive
    """
    from tidal.scheduler.autoscaler.forecast import WEEK_HOURS, HourOfWeekProfile
    from tidal.scheduler.autoscaler.history import HistoryError, read_history
    from tidal.settings import get_settings

    try:
        history = read_history(file, fmt)  # type: ignore[arg-type]  # click.Choice checked it
    except HistoryError as exc:
        raise click.ClickException(str(exc)) from None
    profile = history.profile(utc_offset_s=utc_offset * 3600.0)

    def day(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M")

    click.echo(
        f"{history.source}: {history.minutes} minutes of history, {day(history.start)} to "
        f"{day(history.end)} UTC; {profile.trained_hours} of {WEEK_HOURS} hours of the week learned"
    )
    rates = [(h, profile.predict_hour(h)) for h in range(WEEK_HOURS)]
    known = [(h, r) for h, r in rates if r is not None]
    if known:
        h, r = max(known, key=lambda x: x[1])
        low_h, low = min(known, key=lambda x: x[1])
        click.echo(
            f"busiest hour: {_DAYS[h // 24]} {h % 24:02d}:00 at {r:.1f} rps; "
            f"quietest: {_DAYS[low_h // 24]} {low_h % 24:02d}:00 at {low:.1f} rps "
            f"(each hour: the {profile.quantile:.0%} quantile of its per-minute rates)"
        )
    if dry_run:
        return
    target = (data_dir or get_settings().data_dir) / "scheduler" / "autoscaler-profiles.json"
    pools: dict[str, Any] = {}
    data: dict[str, Any] = {"pools": pools}
    if target.exists():
        try:
            loaded = json.loads(target.read_text())
            if not isinstance(loaded, dict) or not isinstance(loaded.get("pools"), dict):
                raise ValueError("no 'pools' object")
            data, pools = loaded, loaded["pools"]
            for saved in pools.values():
                HourOfWeekProfile.from_json(saved)  # the others must survive as they are
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise click.ClickException(
                f"{target} exists but is not a profiles file ({exc}); move it away"
            ) from None
    pools[pool] = profile.to_json()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".import.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, target)
    click.echo(f"pool {pool}: profile written to {target}")
