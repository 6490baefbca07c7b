"""``tidal jobs``: offline evals, embedding backfills and summaries on a Tidal gateway."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from tidal.cli.batch import client_options, make_client

__all__ = ["jobs"]


def _parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint="--option")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw  # a bare string
    return out


def _get_job(client: Any, job_id: str) -> dict[str, Any]:
    import httpx

    resp = client.get(f"/jobs/{job_id}", cast_to=httpx.Response)
    data: dict[str, Any] = resp.json()
    return data


def _print_job(job: dict[str, Any]) -> None:
    cur = job.get("current_batch") or {}
    counts = cur.get("request_counts") or {}
    click.echo(
        f"{job['id']}  {job['kind']}  {job['status']}  stage {job['stage']}  batch {cur.get('id')} "
        f"{counts.get('completed', 0) + counts.get('failed', 0)}/{counts.get('total', 0)}"
    )
    if job.get("error"):
        click.echo(f"  error: {job['error']}")
    if job.get("result"):
        click.echo("  result: " + json.dumps(job["result"]))
    for name, fid in (job.get("output_file_ids") or {}).items():
        click.echo(f"  {name}: {fid}")


@click.group()
def jobs() -> None:
    """Higher-level jobs that compile into batches: eval, embedding_backfill, summaries."""


@jobs.command("submit")
@click.argument("kind", type=click.Choice(["eval", "embedding_backfill", "summaries"]))
@click.argument("dataset", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, help="Served model (or LoRA adapter) to run.")
@click.option(
    "--scorer", default=None, type=click.Choice(["exact", "contains", "regex", "judge"]), help="eval only."
)
@click.option("--priority", default=None, type=click.IntRange(0, 9), help="0..9, 9 most urgent.")
@click.option("--option", "options", multiple=True, help="Kind option as key=value (JSON values allowed).")
@click.option("--watch", is_flag=True, help="Wait and print the result.")
@client_options
def submit(
    kind: str,
    dataset: Path,
    model: str,
    scorer: str | None,
    priority: int | None,
    options: tuple[str, ...],
    watch: bool,
    base_url: str,
    api_key: str | None,
) -> None:
    """Upload DATASET (JSONL, purpose user_data) and start a job of KIND on it.

    Example: tidal jobs submit eval qa.jsonl --model llama-3.1-8b-instruct --scorer contains --watch
    """
    import httpx

    client = make_client(base_url, api_key)
    opts = _parse_options(options)
    if scorer:
        opts["scorer"] = scorer
    if priority is not None:
        opts["priority"] = priority
    with dataset.open("rb") as fh:
        f = client.files.create(file=(dataset.name, fh), purpose="user_data")
    resp = client.post(
        "/jobs",
        body={"kind": kind, "input_file_id": f.id, "model": model, "options": opts},
        cast_to=httpx.Response,
    )
    job: dict[str, Any] = resp.json()
    _print_job(job)
    while watch and job["status"] == "in_progress":
        time.sleep(1.0)
        job = _get_job(client, job["id"])
        click.echo(f"\r  stage {job['stage']} {job['status']}", nl=False)
    if watch:
        click.echo("")
        _print_job(job)
    sys.exit(0 if job["status"] in ("in_progress", "completed") else 1)


@jobs.command("status")
@click.argument("job_id")
@client_options
def status(job_id: str, base_url: str, api_key: str | None) -> None:
    """Show a job: status, stage, current batch progress, result, output files.

    Example: tidal jobs status job_abc123
    """
    _print_job(_get_job(make_client(base_url, api_key), job_id))
