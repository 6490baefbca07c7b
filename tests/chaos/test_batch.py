"""Batch faults, each injected while a 2,000-line batch (the ``openai`` SDK's Files and Batches
through the gateway) runs on ``tidal worker`` processes against two simulated replicas, with
this module's own RabbitMQ node and PostgreSQL cluster, so that killing them touches nothing
else on the machine.

Target in every row: every accepted line answered exactly once (0 lost, 0 duplicated) and the
batch completed, not left hanging.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import create_engine, text

from tests.batch_tier import (
    BatchTier,
    chat_lines,
    openai_client,
    read_jsonl,
    running_tier,
    tiny_fleet,
    wait_for,
)
from tests.chaos.matrix import Row, record
from tests.chaos.services import (
    PrivatePostgres,
    PrivateRabbit,
    service_dir,
)
from tests.services import in_ci
from tidal.replicas.launcher import ReplicaProcess

pytestmark = pytest.mark.slow

LINES = 2000
TERMINAL = ("completed", "failed", "expired", "cancelled")


@contextlib.contextmanager
def _database(pg: PrivatePostgres) -> Iterator[str]:
    import psycopg

    name = f"chaos_{secrets.token_hex(5)}"
    admin = f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/{name}"


@pytest.fixture
def tier(
    tmp_path: Path, services: tuple[PrivateRabbit, PrivatePostgres], sims: list[ReplicaProcess]
) -> Iterator[BatchTier]:
    rabbit, pg = services
    with (
        _database(pg) as url,
        running_tier(tmp_path, url, tiny_fleet([s.url for s in sims]), broker_url=rabbit.url) as t,
    ):
        yield t


def _done(client: openai.OpenAI, batch_id: str) -> int:
    try:
        c = client.batches.retrieve(batch_id).request_counts
    except Exception:  # the store may be restarting: no reading this time
        return -1
    return int(c.completed + c.failed) if c else 0


def _deliveries(tier: BatchTier, batch_id: str) -> list[int]:
    engine = create_engine(tier.database_url)
    try:
        with engine.connect() as c:
            q = text("SELECT deliveries FROM tidal_batch_chunks WHERE batch_id = :b")
            return [int(r[0]) for r in c.execute(q, {"b": batch_id})]
    finally:
        engine.dispose()


def _tally(client: openai.OpenAI, final: Any) -> tuple[dict[str, int], int]:
    """How many times each custom id was answered (output and error files), and how many failed."""
    seen: dict[str, int] = {}
    failed = 0
    for file_id, is_error in ((final.output_file_id, False), (final.error_file_id, True)):
        if file_id:
            for row in read_jsonl(client.files.content(file_id).text):
                seen[row["custom_id"]] = seen.get(row["custom_id"], 0) + 1
                failed += int(is_error)
    return seen, failed


def _final(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> tuple[Any, int]:
    """The batch once it ended, and 1 when it did not end within ``timeout`` (hung)."""
    try:
        return wait_for(
            lambda: (b := client.batches.retrieve(batch_id)).status in TERMINAL and b,
            timeout,
            "the batch to end",
        ), 0
    except AssertionError:
        return client.batches.retrieve(batch_id), 1


def _row(
    tier: BatchTier,
    client: openai.OpenAI,
    final: Any,
    hung: int,
    fault: str,
    recovery: float,
    note: str = "",
    part: str = "batch",
) -> Row:
    seen, failed = _tally(client, final)
    ids = [json.loads(line)["custom_id"] for line in chat_lines(LINES, max_tokens=16).decode().splitlines()]
    deliveries = _deliveries(tier, final.id)
    row = record(
        Row(
            tier=part,
            fault=fault,
            requests=LINES,
            failed=failed,
            retried=sum(d - 1 for d in deliveries if d > 1),
            lost=sum(1 for i in ids if i not in seen),
            duplicated=sum(1 for i in ids if seen.get(i, 0) > 1),
            hung=hung,
            recovery_s=recovery,
            note=note or f"batch {final.status}; retried = chunk redeliveries",
        )
    )
    assert row.lost == 0 and row.duplicated == 0 and row.hung == 0, row
    assert final.status == "completed" and row.failed == 0, (final.status, row)
    return row


def _run(tier: BatchTier, fault: str, inject: Callable[[], None], *, extra_gateway: bool = False) -> Row:
    tier.start_workers(["reserved", "reserved"], concurrency=3)
    with contextlib.ExitStack() as stack:
        gw = stack.enter_context(tier.gateway())
        if extra_gateway:  # a second gateway whose maintenance sweeps the same batches
            stack.enter_context(tier.gateway())
        client = openai_client(gw)
        f = client.files.create(file=("in.jsonl", chat_lines(LINES, max_tokens=16)), purpose="batch")
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(lambda: _done(client, batch.id) >= LINES // 4, 120, "a quarter of the lines")
        before = _done(client, batch.id)
        fault_at = time.monotonic()
        inject()
        wait_for(lambda: _done(client, batch.id) > before, 180, "progress after the fault")
        recovery = time.monotonic() - fault_at
        final, hung = _final(client, batch.id)
        return _row(tier, client, final, hung, fault, recovery)


def test_worker_sigkill_while_writing_results(tier: BatchTier) -> None:
    def kill() -> None:
        tier.workers[0].signal(signal.SIGKILL)
        tier.workers[0].proc.wait(10)
        tier.start_worker("reserved", concurrency=3)  # its replacement (a supervisor's restart)

    row = _run(tier, "worker SIGKILL mid-chunk", kill)
    assert row.retried >= 1  # the killed worker's chunks were delivered again


def test_rabbitmq_node_killed_and_restarted(tier: BatchTier, services: tuple[PrivateRabbit, Any]) -> None:
    rabbit, _ = services

    def crash() -> None:
        rabbit.kill()
        time.sleep(1.0)
        rabbit.start()

    _run(tier, "RabbitMQ node SIGKILL + restart", crash)


def test_postgresql_restarted_immediately(tier: BatchTier, services: tuple[Any, PrivatePostgres]) -> None:
    _, pg = services
    _run(tier, "PostgreSQL immediate restart", pg.restart_immediately)


def test_two_gateways_sweeping_the_same_batches(tier: BatchTier) -> None:
    _run(
        tier,
        "two gateways sweeping, worker SIGKILL",
        lambda: tier.workers[0].signal(signal.SIGKILL),
        extra_gateway=True,
    )


@pytest.fixture
def small_store() -> Iterator[Path]:
    """A 4 MiB tmpfs for the batch tier's files (mounting needs root)."""
    with service_dir() as root:
        mnt = root / "files"
        mnt.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
        )
        if mounted.returncode != 0:
            message = f"cannot mount a tmpfs: {mounted.stderr.strip()}"
            if in_ci():
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    with path.open("wb") as fh:
        block = b"\0" * 65536
        with contextlib.suppress(OSError):
            while True:
                fh.write(block)
                fh.flush()


def test_file_store_full_until_space_is_freed(
    tmp_path: Path,
    services: tuple[PrivateRabbit, PrivatePostgres],
    sims: list[ReplicaProcess],
    small_store: Path,
) -> None:
    rabbit, pg = services
    with (
        _database(pg) as url,
        running_tier(
            tmp_path,
            url,
            tiny_fleet([s.url for s in sims]),
            broker_url=rabbit.url,
            extra_env={"TIDAL_FILES_DIR": str(small_store)},
        ) as tier,
    ):
        tier.start_workers(["reserved", "reserved"], concurrency=3)
        with tier.gateway() as gw:
            client = openai_client(gw)
            f = client.files.create(file=("in.jsonl", chat_lines(LINES, max_tokens=16)), purpose="batch")
            filler = small_store / "filler"
            _fill(filler)
            # An upload into a full store is refused as such, not a 500.
            with pytest.raises(openai.APIStatusError) as full:
                client.files.create(file=("more.jsonl", chat_lines(10)), purpose="batch")
            assert full.value.status_code == 507, full.value
            batch = client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            # Every line is answered, but the output file cannot be written: the batch waits.
            wait_for(lambda: _done(client, batch.id) >= LINES, 180, "every line answered")
            time.sleep(3.0)
            assert client.batches.retrieve(batch.id).status in ("in_progress", "finalizing")
            freed_at = time.monotonic()
            filler.unlink()
            final, hung = _final(client, batch.id, timeout=120)
            recovery = time.monotonic() - freed_at
            _row(
                tier,
                client,
                final,
                hung,
                "file store full, then space freed",
                recovery,
                note="recovery from the space freed to the batch completed",
            )
