"""The chaos suite's shared parts: its own RabbitMQ node and PostgreSQL cluster (started once
for the session; the tests that break them restart them), two simulated replicas, and each
test's outcome for ``tidal bench chaos`` (``TIDAL_CHAOS_REPORT`` names the file)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.services import (
    PrivatePostgres,
    PrivateRabbit,
    private_postgres,
    private_rabbitmq,
    service_dir,
)
from tidal.replicas.launcher import ReplicaProcess, sim_process


@pytest.fixture(scope="session")
def services() -> Iterator[tuple[PrivateRabbit, PrivatePostgres]]:
    with service_dir() as root, private_rabbitmq(root) as rabbit, private_postgres(root) as pg:
        yield rabbit, pg


@contextlib.contextmanager
def running_sims(
    logs: Path, n: int, time_scale: float, *, kv_events: bool = False
) -> Iterator[list[ReplicaProcess]]:
    """``n`` simulated replicas serving ``tiny`` (fast-test's 1 ms steps slowed by ``time_scale``),
    publishing KV events on free ports when ``kv_events``."""
    procs = [
        sim_process(
            "fast-test",
            name=f"chaos-sim-{i}",
            args=["--served-model-name", "tiny", "--time-scale", str(time_scale)],
            log_path=logs / f"sim-{i}.log",
            kv_events=kv_events,
        )
        for i in range(n)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(60)
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="session")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ReplicaProcess]]:
    """Two replicas at 20 ms steps, shared by the tests that do not break them."""
    with running_sims(tmp_path_factory.mktemp("chaos-sims"), 2, 0.05) as procs:
        yield procs


_outcomes: dict[str, str] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report: Any = yield
    if report.when == "call" or report.failed:
        _outcomes[item.nodeid] = (
            "passed" if report.passed and _outcomes.get(item.nodeid) != "failed" else "failed"
        )
        path = os.environ.get("TIDAL_CHAOS_REPORT")
        if path:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(_outcomes, fh)
    return report  # type: ignore[no-any-return]
