"""``tidal batch``: submit OpenAI-format batches to a Tidal gateway and follow them."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

__all__ = ["batch", "client_options", "make_client", "watch_batch"]


def _friendly(f: Any) -> Any:
    """Print an API refusal as one line (status and message) instead of a traceback."""
    import functools

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import openai

        try:
            return f(*args, **kwargs)
        except openai.APIStatusError as exc:
            click.echo(f"error {exc.status_code}: {exc.message}", err=True)
            sys.exit(1)
        except openai.APIConnectionError as exc:
            click.echo(f"cannot reach the gateway: {exc}", err=True)
            sys.exit(1)

    return wrapper


TERMINAL = ("completed", "failed", "expired", "cancelled")


def client_options(f: Any) -> Any:
    f = _friendly(f)
    f = click.option(
        "--api-key",
        envvar="TIDAL_API_KEY",
        default=None,
        help="API key (default: $TIDAL_API_KEY, else $OPENAI_API_KEY).",
    )(f)
    f = click.option(
        "--base-url",
        envvar="TIDAL_BASE_URL",
        default="http://127.0.0.1:8000/v1",
        show_default=True,
        help="The gateway's OpenAI base URL ($TIDAL_BASE_URL).",
    )(f)
    return f


def make_client(base_url: str, api_key: str | None) -> Any:
    import openai

    key = api_key or os.environ.get("OPENAI_API_KEY")
    if not key:
        raise click.UsageError("no API key: pass --api-key or set TIDAL_API_KEY")
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=3)


def watch_batch(client: Any, batch_id: str, *, interval: float = 1.0) -> Any:
    """Poll a batch with a progress bar until it is final; returns the final batch."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]} failed={task.fields[failed]}"),
        TimeElapsedColumn(),
        transient=False,
    ) as progress:
        task = progress.add_task(batch_id, total=None, status="", failed=0)
        while True:
            b = client.batches.retrieve(batch_id)
            counts = b.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            progress.update(
                task,
                total=counts.total if counts and counts.total else None,
                completed=done,
                status=b.status,
                failed=counts.failed if counts else 0,
            )
            if b.status in TERMINAL:
                return b
            time.sleep(interval)


def _print_batch(b: Any) -> None:
    counts = b.request_counts
    click.echo(
        f"{b.id}  {b.status}  completed={counts.completed if counts else 0} failed={counts.failed if counts else 0} "
        f"total={counts.total if counts else 0}"
    )
    if b.errors and b.errors.data:
        for e in b.errors.data[:20]:
            click.echo(f"  line {e.line}: [{e.code}] {e.message}")
    if b.output_file_id:
        click.echo(f"  output file: {b.output_file_id}")
    if b.error_file_id:
        click.echo(f"  error file:  {b.error_file_id}")


@click.group()
def batch() -> None:
    """OpenAI-format batches on a Tidal gateway (the same calls the `openai` SDK makes)."""


@batch.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--endpoint",
    default=None,
    type=click.Choice(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
    help="Endpoint of every line (default: the first line's url).",
)
@click.option("--priority", default=None, type=click.IntRange(0, 9), help="0..9, 9 most urgent.")
@click.option(
    "--lane", default=None, type=click.Choice(["reserved", "spot", "any"]), help="Where it may run."
)
@click.option("--watch", is_flag=True, help="Show a progress bar until the batch is final.")
@click.option(
    "--out",
    "out_dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="With --watch: write the output and error files here.",
)
@client_options
def submit(
    file: Path,
    endpoint: str | None,
    priority: int | None,
    lane: str | None,
    watch: bool,
    out_dir: Path | None,
    base_url: str,
    api_key: str | None,
) -> None:
    """Upload a JSONL file (purpose batch) and create a batch from it.

    Example: tidal batch submit requests.jsonl --priority 7 --lane spot --watch --out results/
    """
    client = make_client(base_url, api_key)
    if endpoint is None:
        with file.open("rb") as fh:
            first = next((ln for ln in fh if ln.strip()), b"{}")
        try:
            endpoint = str(json.loads(first).get("url") or "/v1/chat/completions")
        except ValueError:
            endpoint = "/v1/chat/completions"
    metadata: dict[str, str] = {}
    if priority is not None:
        metadata["priority"] = str(priority)
    if lane is not None:
        metadata["lane"] = lane
    with file.open("rb") as fh:
        f = client.files.create(file=(file.name, fh), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint=endpoint, completion_window="24h", metadata=metadata or None
    )
    click.echo(f"batch {b.id} created from {f.id} ({f.bytes} bytes): {b.status}")
    if b.status == "failed" or not watch:
        _print_batch(b)
        sys.exit(1 if b.status == "failed" else 0)
    b = watch_batch(client, b.id)
    _print_batch(b)
    if out_dir is not None:
        _download(client, b, out_dir)
    sys.exit(0 if b.status == "completed" else 1)


def _download(client: Any, b: Any, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind, fid in (("output", b.output_file_id), ("errors", b.error_file_id)):
        if fid:
            path = out_dir / f"{b.id}_{kind}.jsonl"
            path.write_bytes(client.files.content(fid).read())
            click.echo(f"  wrote {path}")


@batch.command("status")
@click.argument("batch_id")
@click.option("--watch", is_flag=True, help="Follow it with a progress bar.")
@client_options
def status(batch_id: str, watch: bool, base_url: str, api_key: str | None) -> None:
    """Show a batch's status and request counts.

    Example: tidal batch status batch_abc123 --watch
    """
    client = make_client(base_url, api_key)
    b = watch_batch(client, batch_id) if watch else client.batches.retrieve(batch_id)
    _print_batch(b)


@batch.command("list")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 100), help="How many.")
@client_options
def list_(limit: int, base_url: str, api_key: str | None) -> None:
    """List your most recent batches.

    Example: tidal batch list --limit 5
    """
    client = make_client(base_url, api_key)
    for b in client.batches.list(limit=limit).data:
        _print_batch(b)


@batch.command("cancel")
@click.argument("batch_id")
@client_options
def cancel(batch_id: str, base_url: str, api_key: str | None) -> None:
    """Cancel a batch; lines already answered stay in its output file.

    Example: tidal batch cancel batch_abc123
    """
    _print_batch(make_client(base_url, api_key).batches.cancel(batch_id))


@batch.command("results")
@click.argument("batch_id")
@click.option(
    "--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path), help="Directory."
)
@client_options
def results(batch_id: str, out_dir: Path, base_url: str, api_key: str | None) -> None:
    """Download a final batch's output and error files.

    Example: tidal batch results batch_abc123 --out results/
    """
    client = make_client(base_url, api_key)
    _download(client, client.batches.retrieve(batch_id), out_dir)
