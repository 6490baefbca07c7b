"""The autoscaler's actuator failing under a demand signal: the loop must outlive it, keep
retrying, say so, and reach the pool's size once the actuator works again.

Real parts: ``tidal gateway`` in front of one fleet replica (a simulated one of the suite's),
closed-loop streaming clients whose traffic is the demand signal, the scheduler's
:class:`~scheduler.autoscaler.AutoscalerLoop` (in this process, as ``tidal scheduler`` runs it)
reading the gateway's ``/admin/load``, and its local-process actuator starting real ``tidal sim``
processes and registering them through the gateway's admin API. The actuator fails two ways,
each on its real boundary:

1. **It raises**: the replica's launch command cannot be executed (its binary is missing, as
   during an upgrade), so ``scale()`` raises ``FileNotFoundError``.
2. **It times out**: the replicas start, but the gateway's admin API does not answer the
   actuator (a :class:`~tests.chaos.netproxy.FaultProxy` partition between them), so every
   registration times out and the actuator stops the replica it could not register.

Targets: the loop keeps deciding through both (it never crashes), the failures are counted
(``tidal_autoscaler_actuator_errors_total``, the actuator's failed starts) while the desired
replicas gauge keeps asking for the pool's size, no client request fails, and the pool reaches
its size once the actuator heals; the recovery time is from the heal to the desired replicas
serving, as the gateway lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.api.harness import ADMIN_KEY, DEV_KEY, Gateway, fleet_dict, run_gateway
from tests.chaos.matrix import StreamingClients, record
from tests.chaos.netproxy import FaultProxy
from tidal.clock import SystemClock
from tidal.fleet import AutoscalerSpec
from tidal.replicas.launcher import ReplicaProcess, sim_process
from tidal.scheduler.autoscaler import Autoscaler, AutoscalerLoop, StaticCapacity, make_policy
from tidal.scheduler.autoscaler.local import LocalProcessActuator, LocalTemplate
from tidal.scheduler.gateway import GatewayAdmin
from tidal.scheduler.metrics import SchedulerMetrics

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

POOL = "interactive"
TIME_SCALE = "0.05"  # the suite's replicas' pace
WANT = 3  # the pool's size under the clients' demand (max_replicas: any traffic asks for it)
SPEC = AutoscalerSpec(
    min_replicas=1,
    max_replicas=WANT,
    capacity_rps_per_replica=0.1,  # so that the clients' few requests/s need every replica
    decision_interval_s=0.25,  # 15 s in production; shorter keeps the test short
    scale_down_stabilisation_s=600,
    cold_start_s=5,
    policy="reactive",
)
RAISING_S = 3.0  # how long the launch command is missing
ADMIN_TIMEOUT_S = 1.0  # the actuator's admin API calls (2 s in production)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Launcher:
    """The actuator's process factory: a ``tidal sim``, or, while ``broken``, a command whose
    binary does not exist (``Popen`` raises in the actuator's ``scale()``)."""

    def __init__(self, missing: Path) -> None:
        self.broken = True
        self.missing = missing

    def __call__(self, pool: str, name: str, port: int, log_path: Path) -> ReplicaProcess:
        if self.broken:
            return ReplicaProcess(
                name, [str(self.missing), "--port", str(port)], port=port, log_path=log_path
            )
        args = ["--served-model-name", "tiny", "--time-scale", TIME_SCALE]
        return sim_process("fast-test", port=port, name=name, args=args, log_path=log_path)


def _serving(gw: Gateway) -> int:
    rows = gw.admin("GET", "/admin/replicas").json()["data"]
    return sum(1 for r in rows if r["pool"] == POOL and r["healthy"] and not r.get("draining"))


def _value(metrics: SchedulerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not await asyncio.to_thread(cond):
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout:g} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_autoscaler_actuator_failing_then_healed(tmp_path: Path, sims: list[ReplicaProcess]) -> None:
    launcher = Launcher(tmp_path / "missing" / "tidal-sim")
    metrics = SchedulerMetrics()
    labels = {"pool": POOL, "actuator": "local"}
    with run_gateway(tmp_path, fleet_dict([sims[0].url])) as gw, FaultProxy(gw.proc.port) as admin_link:
        source = GatewayAdmin([gw.url], admin_key=ADMIN_KEY)
        registry = GatewayAdmin([admin_link.url], admin_key=ADMIN_KEY, timeout_s=ADMIN_TIMEOUT_S)
        actuator = LocalProcessActuator(
            {POOL: LocalTemplate(kind="sim", preset="fast-test", served_model_name="tiny")},
            registry=registry,
            fixed={POOL: 1},
            factory=launcher,
            log_dir=tmp_path / "autoscaler",
            ready_timeout_s=60,
        )
        scaler = Autoscaler(
            POOL,
            SPEC,
            make_policy("reactive"),
            capacity=StaticCapacity({POOL: SPEC.capacity_rps_per_replica}),
            actuator=actuator,
            clock=SystemClock(),
            metrics=metrics,
        )
        loop = AutoscalerLoop([scaler], source=source, clock=SystemClock())
        stop = asyncio.Event()
        loop_task = asyncio.create_task(loop.run(stop))
        clients = StreamingClients(gw.url, DEV_KEY, workers=4, max_tokens=32, timeout_s=20.0)
        clients.start()
        try:
            # Given demand that needs WANT replicas, and an actuator whose launch command is missing,
            await _until(
                lambda: _value(metrics, "tidal_autoscaler_actuator_errors_total", **labels) >= 1,
                20,
                "the first actuator error",
            )
            decisions0 = sum(
                _value(metrics, "tidal_autoscaler_decisions_total", pool=POOL, policy="reactive", direction=d)
                for d in ("up", "down", "hold")
            )
            await asyncio.sleep(RAISING_S)
            # then the loop goes on deciding, retries every decision and counts each failure,
            raised = _value(metrics, "tidal_autoscaler_actuator_errors_total", **labels)
            decisions = (
                sum(
                    _value(
                        metrics, "tidal_autoscaler_decisions_total", pool=POOL, policy="reactive", direction=d
                    )
                    for d in ("up", "down", "hold")
                )
                - decisions0
            )
            assert not loop_task.done(), loop_task
            assert raised >= 3 and decisions >= 3, (raised, decisions)
            assert _value(metrics, "tidal_autoscaler_desired_replicas", pool=POOL) == WANT
            assert await asyncio.to_thread(_serving, gw) == 1
            # When the replicas start but the admin API times out on the actuator,
            admin_link.partition()
            launcher.broken = False
            await _until(lambda: actuator.failed_starts >= 1, 60, "a registration to time out")
            timed_out = actuator.failed_starts
            # then no replica it could not register is left running or listed,
            assert not loop_task.done(), loop_task
            assert await asyncio.to_thread(_serving, gw) == 1
            # and when the actuator heals, the pool reaches its size.
            admin_link.restore()
            recovery_s = await _until(lambda: _serving(gw) == WANT, 60, f"{WANT} replicas serving")
            await asyncio.sleep(2.0)
            # (and the autoscaler sees them: its own view converged, nothing more is asked for)
            last = loop.last[POOL]
            assert (last.ready, last.starting, last.target) == (WANT, 0, WANT), last
            assert await asyncio.to_thread(_serving, gw) == WANT
        finally:
            await clients.stop()
            stop.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(loop_task, 10)
            await actuator.aclose()
            await source.aclose()
            await registry.aclose()
    errors = _value(metrics, "tidal_autoscaler_actuator_errors_total", **labels)
    note = (
        f"launch command missing {RAISING_S:g} s ({raised:.0f} actuator errors counted, the loop "
        f"deciding every {SPEC.decision_interval_s:g} s), then the admin API partitioned from the "
        f"actuator ({timed_out} registrations timed out after {ADMIN_TIMEOUT_S:g} s, their replicas "
        f"stopped); retried = actuator calls that failed; recovery from the heal to {WANT} "
        "replicas serving"
    )
    fault = "autoscaler actuator failing, then healed"
    row = record(clients.row("scheduler", fault, recovery_s, note, retried=int(errors) + timed_out))
    assert row.failed == row.hung == row.lost == row.duplicated == 0, clients.summary()
