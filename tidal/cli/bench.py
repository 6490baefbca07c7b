"""``tidal bench``: run a benchmark, print its table, write ``bench/results/NAME.json``."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

__all__ = ["bench", "bench_options", "print_table", "write_results"]


def write_results(name: str, rows: Any, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(rows, indent=2, sort_keys=False) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    if not rows:
        click.echo("(no rows)")
        return
    columns = columns or list(rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def bench_options(run: Callable[..., Any]) -> list[str]:
    """The options a benchmark's ``run`` takes besides ``quick`` and ``out_dir`` (as parameter
    names: ``--max-rss-gb`` is ``max_rss_gb``)."""
    return [
        p.name
        for p in inspect.signature(run).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("quick", "out_dir")
    ]


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("name", required=False)
@click.option("--quick", is_flag=True, help="A short run (about a minute) instead of the full one.")
@click.option(
    "--out",
    "out_dir",
    default=Path("bench/results"),
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where to write NAME.json.",
)
@click.option("--list", "list_", is_flag=True, help="List the benchmarks.")
@click.pass_context
def bench(ctx: click.Context, name: str | None, quick: bool, out_dir: Path, list_: bool) -> None:
    """Run the benchmark NAME; it prints a table and writes bench/results/NAME.json.

    Extra `--key value` options go to the benchmark (e.g. `--trace FILE` for routing).

    Example: tidal bench routing --quick
    """
    from tidal.bench import BENCHMARKS

    if list_ or not name:
        for n in BENCHMARKS:
            click.echo(n)
        return
    if name not in BENCHMARKS:
        click.echo(f"unknown benchmark '{name}' (known: {', '.join(BENCHMARKS) or 'none'})", err=True)
        sys.exit(2)
    options: dict[str, Any] = {}
    args = list(ctx.args)
    while args:
        flag = args.pop(0)
        if not flag.startswith("--"):
            raise click.UsageError(f"unexpected argument {flag!r}")
        key = flag[2:].replace("-", "_")
        if args and not args[0].startswith("--"):
            value: Any = args.pop(0)
            if key in options:
                prev = options[key]
                options[key] = (prev if isinstance(prev, list) else [prev]) + [value]
            else:
                options[key] = value
        else:
            options[key] = True
    module_name, func = BENCHMARKS[name].split(":")
    run = getattr(importlib.import_module(module_name), func)
    known = bench_options(run)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise click.UsageError(
            f"unknown option(s) for benchmark '{name}': {', '.join('--' + k.replace('_', '-') for k in unknown)}"
            f" (known: {', '.join('--' + k.replace('_', '-') for k in known) or 'none'})"
        )
    t0 = time.perf_counter()
    rows = run(quick=quick, out_dir=out_dir, **options)
    path = write_results(name, rows, out_dir)
    click.echo(f"\n{name}: {time.perf_counter() - t0:.1f} s wall; results in {path}")
