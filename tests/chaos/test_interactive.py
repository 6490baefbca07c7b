"""Interactive faults, each injected into real processes this test started: two simulated
replicas, ``tidal gateway``, the scheduler's health prober (in this process, as the scheduler
runs it), and eight closed-loop streaming clients on the ``openai`` SDK.

Targets in every row: no request hung past its client's timeout, none cut silently (``lost``),
none answered twice; after recovery every request succeeds.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.api.harness import ADMIN_KEY, DEV_KEY, Gateway, fleet_dict, run_gateway
from tests.chaos.conftest import running_sims
from tests.chaos.matrix import Row, StreamingClients, record
from tidal.clock import SystemClock
from tidal.replicas.launcher import ReplicaProcess
from tidal.scheduler.gateway import GatewayAdmin
from tidal.scheduler.health import CanaryGeneration, HealthProber
from tidal.scheduler.metrics import SchedulerMetrics

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIME_SCALE = 0.04  # a fast-test step of 1 ms lasts 25 ms: a 64-token stream about 1.7 s
PERIOD_S = 0.5  # the prober's period (a second in production; shorter keeps the test short)
RUN_BEFORE_S = 3.0  # traffic before the fault
RUN_AFTER_S = 7.0  # and after it
SETTLED_S = 4.0  # requests started this long after the fault (and any restart) must all succeed


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Scene:
    sims: list[ReplicaProcess]
    gateway: Gateway
    tmp: Path


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    # Replicas of this test's own: it kills or freezes one.
    with (
        running_sims(tmp_path, 2, TIME_SCALE) as sims,
        run_gateway(tmp_path, fleet_dict([s.url for s in sims])) as gw,
    ):
        yield Scene(sims, gw, tmp_path)


@pytest.fixture
async def prober(scene: Scene) -> AsyncIterator[HealthProber]:
    admin = GatewayAdmin([scene.gateway.url], admin_key=ADMIN_KEY)
    probe = CanaryGeneration({"interactive": "tiny"}, timeout_s=0.3)
    hp = HealthProber(
        admin, probe, clock=SystemClock(), period_s=PERIOD_S, recover_after=2, metrics=SchedulerMetrics()
    )
    stop = asyncio.Event()
    task = asyncio.create_task(hp.run(stop))
    try:
        yield hp
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await probe.aclose()
        await admin.aclose()


def _retries(gw: Gateway) -> int:
    try:
        return int(gw.metric("tidal_gateway_retries_total"))
    except httpx.HTTPError:
        return 0


async def _run(
    scene: Scene, fault: str, inject: object, note: str = ""
) -> tuple[Row, StreamingClients, float]:
    clients = StreamingClients(scene.gateway.url, DEV_KEY, workers=8, max_tokens=64, timeout_s=20.0)
    retries0 = _retries(scene.gateway)
    clients.start()
    await asyncio.sleep(RUN_BEFORE_S)
    fault_at = time.monotonic()
    retries_before = await asyncio.to_thread(inject)  # type: ignore[arg-type]
    injected_at = time.monotonic()  # a restart (the gateway row) is part of the fault
    await asyncio.sleep(RUN_AFTER_S)
    await clients.stop()
    retried = _retries(scene.gateway) + int(retries_before or 0) - retries0
    row = record(clients.row("interactive", fault, clients.recovery_s(fault_at), note, retried=retried))
    return row, clients, injected_at


def _check(row: Row, clients: StreamingClients, injected_at: float) -> None:
    assert row.hung == 0 and row.lost == 0 and row.duplicated == 0, clients.summary()
    late = [o for o in clients.outcomes if o.start >= injected_at + SETTLED_S]
    assert late, "no request started after the fault settled"
    assert all(o.kind == "ok" for o in late), clients.summary()


async def test_replica_sigkill_mid_stream(scene: Scene, prober: HealthProber) -> None:
    row, clients, injected_at = await _run(
        scene, "replica SIGKILL mid-stream", lambda: scene.sims[0].send_signal(signal.SIGKILL)
    )
    _check(row, clients, injected_at)
    # Streams cut after their first token end with an error the client sees (retrying them would
    # answer twice); the rest went to the other replica.
    assert row.failed <= clients.workers, clients.summary()


async def test_replica_sigstop_mid_stream(scene: Scene, prober: HealthProber) -> None:
    try:
        row, clients, injected_at = await _run(
            scene,
            "replica SIGSTOP mid-stream",
            lambda: scene.sims[0].send_signal(signal.SIGSTOP),
            note=f"health prober period {PERIOD_S} s",
        )
    finally:
        scene.sims[0].send_signal(signal.SIGCONT)
    _check(row, clients, injected_at)
    # The frozen replica's streams end once the prober marks it out, well inside the timeout.
    assert row.recovery_s is not None and row.recovery_s < SETTLED_S, clients.summary()


async def test_gateway_sigkill_with_streams_open(scene: Scene) -> None:
    gw = scene.gateway.proc

    def kill_and_restart() -> int:
        before = _retries(scene.gateway)
        gw.send_signal(signal.SIGKILL)
        assert gw.proc is not None
        gw.proc.wait(10)
        time.sleep(0.5)  # the supervisor notices and starts a new one
        gw.start()
        gw.wait_ready(60)
        return before

    row, clients, injected_at = await _run(
        scene, "gateway SIGKILL, streams open", kill_and_restart, note="restarted by its supervisor"
    )
    # Every open stream ended with an error (a dropped connection), none hung; the new process
    # serves every request after it is up.
    assert row.failed >= 1, clients.summary()
    _check(row, clients, injected_at)
