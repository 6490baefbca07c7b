"""The health prober end to end: a real vLLM CPU replica (started for this module: it gets
paused) and a ``tidal sim`` replica behind a real gateway process, the prober marking them in
``/admin`` as its one-token canaries pass or fail.

* SIGSTOP the vLLM replica: out of routing within two probe periods (measured on ``GET
  /admin/replicas``), its in-flight requests end fast (a stream with a retryable error event,
  a request without output retried on the other replica), and users see no error; SIGCONT:
  back only after ``recover_after`` consecutive good probes.
* SIGKILL a replica: out of routing, and no request through the gateway is sent to it again.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.harness import ADMIN_KEY, DEV_KEY, Gateway, fleet_dict, run_gateway, session_for
from tests.scheduler.processes import Traffic, sim_replicas
from tidal.clock import SystemClock
from tidal.replicas.launcher import ReplicaProcess
from tidal.scheduler.gateway import GatewayAdmin
from tidal.scheduler.health import CanaryGeneration, HealthProber
from tidal.scheduler.metrics import SchedulerMetrics

pytestmark = [pytest.mark.anyio, pytest.mark.vllm, pytest.mark.slow]

PERIOD_S = 1.0
TIMEOUT_S = 0.5
RECOVER_AFTER = 3
PROMPTS = [f"Tell me about the number {i}." for i in range(20)]


@pytest.fixture(scope="module")
def paused_vllm(vllm_factory: Any) -> Iterator[ReplicaProcess]:
    """A vLLM replica of this module's own (the session's shared pair must never be paused)."""
    proc: ReplicaProcess = vllm_factory.start(1)[0]
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)  # whatever happened, leave it running for the factory to stop


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    with sim_replicas(tmp_path_factory.mktemp("health-sims"), {"steady": []}) as procs:
        yield procs["steady"]


@pytest.fixture(scope="module")
def gateway(
    paused_vllm: ReplicaProcess, sim: ReplicaProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    # replica-0 is the vLLM replica, replica-1 the simulated one; both serve "tiny".
    with run_gateway(tmp_path_factory.mktemp("gw-health"), fleet_dict([paused_vllm.url, sim.url])) as gw:
        yield gw


@pytest.fixture
async def prober(gateway: Gateway) -> AsyncIterator[tuple[GatewayAdmin, HealthProber]]:
    """The prober running against the gateway (period 1 s, timeout 0.5 s) for one test."""
    admin = GatewayAdmin([gateway.url], admin_key=ADMIN_KEY)
    probe = CanaryGeneration({"interactive": "tiny"}, timeout_s=TIMEOUT_S)
    hp = HealthProber(
        admin,
        probe,
        clock=SystemClock(),
        period_s=PERIOD_S,
        recover_after=RECOVER_AFTER,
        metrics=SchedulerMetrics(),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(hp.run(stop))
    try:
        yield admin, hp
    finally:
        stop.set()
        await asyncio.wait_for(task, 5 * PERIOD_S)
        await probe.aclose()
        await admin.aclose()


async def _healthy(admin: GatewayAdmin, name: str) -> bool:
    return next(v.healthy for v in await admin.replicas() if v.name == name)


async def _out(admin: GatewayAdmin, name: str) -> bool:
    return not await _healthy(admin, name)


async def _until(check: Callable[[], Any], timeout: float, what: str) -> float:
    """Poll ``check`` every 50 ms until it returns true; the seconds it took."""
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not {what} after {timeout:.0f} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def _transitions(hp: HealthProber, replica: str, to: str) -> float:
    value = hp.metrics.registry.get_sample_value(
        "tidal_health_transitions_total", {"replica": replica, "to": to}
    )
    return value or 0.0


async def _stream_events(
    client: httpx.AsyncClient, session: str, on_event: Callable[[int], None]
) -> list[str]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 2500,
        "stream": True,
        "ignore_eos": True,
    }
    events: list[str] = []
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session}
    ) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line)
                on_event(len(events))
    return events


async def test_a_paused_vllm_replica_is_out_within_two_periods_and_back_after_consecutive_successes(
    gateway: Gateway, paused_vllm: ReplicaProcess, prober: tuple[GatewayAdmin, HealthProber]
) -> None:
    admin, hp = prober
    on_vllm = session_for("replica-0", ["replica-0", "replica-1"])
    client = httpx.AsyncClient(
        base_url=gateway.url, headers={"Authorization": f"Bearer {DEV_KEY}"}, timeout=60
    )
    # Given both replicas in routing after a few good probes
    await _until(lambda: _healthy(admin, "replica-0"), 30, "replica-0 healthy")
    await asyncio.sleep(2 * PERIOD_S)
    assert _transitions(hp, "replica-0", "unhealthy") == 0, "the vLLM replica failed a probe while running"
    decisions = gateway.metric("tidal_router_decisions_total", replica="replica-0")
    retries = gateway.metric("tidal_gateway_retries_total")
    try:
        # When the vLLM replica is frozen while it streams a long answer
        stopped = asyncio.get_running_loop().create_future()

        def freeze_after_tokens(n: int) -> None:
            if n == 5 and not stopped.done():
                paused_vllm.send_signal(signal.SIGSTOP)
                stopped.set_result(time.monotonic())

        stream = asyncio.create_task(_stream_events(client, on_vllm, freeze_after_tokens))
        t_stop = await asyncio.wait_for(stopped, 60)
        # ... and a request for the same replica arrives before anything noticed
        waiting = asyncio.create_task(
            client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                headers={"X-Session-Id": on_vllm},
            )
        )
        # Then it is out of routing within two probe periods
        await _until(lambda: _out(admin, "replica-0"), 5, "out of routing")
        out_s = time.monotonic() - t_stop
        assert out_s <= 2 * PERIOD_S, f"out of routing after {out_s:.2f} s"
        # and its in-flight requests end fast: the stream with a retryable error event ...
        events = await asyncio.wait_for(stream, 5)
        stream_s = time.monotonic() - t_stop
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == "upstream_failed" and error["retryable"] is True
        # ... the request without output retried on the other replica, answered
        answer = await asyncio.wait_for(waiting, 10)
        waiting_s = time.monotonic() - t_stop
        assert answer.status_code == 200, answer.text
        assert gateway.metric("tidal_gateway_retries_total") - retries == 1
        # And while it is out, users' requests all go to the other replica and succeed
        traffic = Traffic(gateway, PROMPTS)
        await traffic.send(30)
        await traffic.aclose()
        assert traffic.failed == [] and traffic.ok >= 30
        assert gateway.metric("tidal_router_decisions_total", replica="replica-0") == decisions + 2
    finally:
        # When it is continued
        paused_vllm.send_signal(signal.SIGCONT)
        t_cont = time.monotonic()
    # Then it returns only after RECOVER_AFTER consecutive successful probes: RECOVER_AFTER - 1
    # periods after the first (a probe sent up to TIMEOUT_S before SIGCONT may be that one)
    await _until(lambda: _healthy(admin, "replica-0"), 10 * PERIOD_S, "back in routing")
    back_s = time.monotonic() - t_cont
    assert (RECOVER_AFTER - 1) * PERIOD_S - TIMEOUT_S <= back_s <= (RECOVER_AFTER + 2) * PERIOD_S, back_s
    assert _transitions(hp, "replica-0", "unhealthy") == 1 and _transitions(hp, "replica-0", "healthy") == 1
    await client.aclose()
    # and takes its part of users' requests again
    traffic = Traffic(gateway, PROMPTS)
    await traffic.send(30)
    await traffic.aclose()
    assert traffic.failed == []
    assert gateway.metric("tidal_router_decisions_total", replica="replica-0") > decisions + 2
    print(
        f"\nSIGSTOP: out of routing after {out_s:.2f} s (period {PERIOD_S} s, timeout {TIMEOUT_S} s); "
        f"stream ended with a retryable error after {stream_s:.2f} s; waiting request answered by the "
        f"other replica after {waiting_s:.2f} s; SIGCONT: back after {back_s:.2f} s"
    )


async def test_a_killed_replica_never_receives_another_request(
    gateway: Gateway, prober: tuple[GatewayAdmin, HealthProber], tmp_path: Path
) -> None:
    admin, hp = prober
    with sim_replicas(tmp_path, {"doomed": []}) as procs:
        doomed = procs["doomed"]
        # Given a third replica registered at run time and taking its part of the traffic
        await admin.register("doomed", doomed.url, "interactive")
        try:
            traffic = Traffic(gateway, PROMPTS, workers=6)
            await traffic.send(60)
            assert gateway.metric("tidal_router_decisions_total", replica="doomed") > 0
            # When it is killed while users' requests flow
            traffic.start()
            await asyncio.sleep(0.5)
            doomed.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            assert doomed.proc is not None
            doomed.proc.wait(5)
            # Then the prober takes it out of routing within two periods
            await _until(lambda: _out(admin, "doomed"), 5, "out of routing")
            out_s = time.monotonic() - t_kill
            assert out_s <= 2 * PERIOD_S, out_s
            await traffic.stop()
            assert traffic.failed == [], traffic.failed[:3]  # the requests it dropped were retried
            # and from then on no request is routed or sent to it: users' requests all succeed
            # on the other replicas at once (not one retry), and its counters stand still
            decisions = gateway.metric("tidal_router_decisions_total", replica="doomed")
            upstream_errors = gateway.metric("tidal_gateway_upstream_errors_total", replica="doomed")
            retries = gateway.metric("tidal_gateway_retries_total")
            await traffic.send(100)
            await traffic.aclose()
            assert traffic.failed == [], traffic.failed[:3]
            assert gateway.metric("tidal_router_decisions_total", replica="doomed") == decisions
            assert gateway.metric("tidal_gateway_upstream_errors_total", replica="doomed") == upstream_errors
            assert gateway.metric("tidal_gateway_retries_total") == retries
            assert not await _healthy(admin, "doomed")  # the failing probes keep it out
            assert _transitions(hp, "doomed", "healthy") == 0
        finally:
            await admin.deregister("doomed", drain_timeout_s=1.0)
    print(f"\nSIGKILL: out of routing after {out_s:.2f} s; 100 requests after it, none routed to it")
