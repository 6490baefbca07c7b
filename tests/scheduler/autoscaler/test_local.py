"""The local-process actuator with real processes: start, register when healthy, drain, stop.

The processes are minimal HTTP servers with a ``/health`` endpoint (what the actuator needs of a
replica); the registry is an in-memory stand-in for the gateway's admin API.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from tidal.replicas.launcher import ReplicaProcess
from tidal.scheduler.autoscaler.actuators import PoolReplicas
from tidal.scheduler.autoscaler.local import LocalProcessActuator, LocalTemplate
from tidal.scheduler.signals import ReplicaView

pytestmark = pytest.mark.anyio

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class Registry:
    def __init__(self) -> None:
        self.registered: dict[str, tuple[str, str, str]] = {}
        self.kv_events: dict[str, Mapping[str, str | None] | None] = {}
        self.log: list[tuple[str, str]] = []

    async def replicas(self) -> list[ReplicaView]:
        return [ReplicaView(n, u, p, g) for n, (u, p, g) in self.registered.items()]

    async def register(
        self,
        name: str,
        url: str,
        pool: str,
        *,
        group: str = "stable",
        weight: float = 1.0,
        max_loras: int = 0,
        kv_events: Mapping[str, str | None] | None = None,
    ) -> None:
        self.registered[name] = (url, pool, group)
        self.kv_events[name] = kv_events
        self.log.append(("register", name))

    async def update(
        self,
        name: str,
        *,
        healthy: bool | None = None,
        weight: float | None = None,
        draining: bool | None = None,
    ) -> None:
        self.log.append(("update", name))

    async def deregister(self, name: str) -> None:
        self.registered.pop(name, None)
        self.log.append(("deregister", name))


def factory(broken: set[str]) -> object:
    def make(pool: str, name: str, port: int, log_path: Path) -> ReplicaProcess:
        code = "import sys; sys.exit(3)" if name in broken else SERVER
        return ReplicaProcess(name, [sys.executable, "-c", code, str(port)], port=port, log_path=log_path)

    return make


async def until(predicate: object, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.1)):
        if await predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not reached")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_processes_are_started_registered_when_healthy_and_stopped_after_draining(
    tmp_path: Path,
) -> None:
    registry = Registry()
    template = LocalTemplate(kind="sim", preset="test", served_model_name="tiny", group="canary")
    actuator = LocalProcessActuator(
        {"interactive": template},
        registry=registry,
        fixed={"interactive": 1},
        factory=factory(set()),  # type: ignore[arg-type]
        log_dir=tmp_path,
        ready_timeout_s=20,
        reconcile_every_s=0,
    )
    try:
        # Given one fixed replica; when the pool is scaled to 3
        await actuator.scale("interactive", 3)
        seen = await actuator.observe("interactive", None)
        # Then two processes cold-start, and are registered (in their group) once healthy
        assert seen.total == 3 and seen.starting >= 1

        async def both_ready() -> bool:
            return await actuator.observe("interactive", None) == PoolReplicas(3, 0)

        await until(both_ready)
        assert len(registry.registered) == 2
        assert {g for _, _, g in registry.registered.values()} == {"canary"}
        pids = {n: m.proc.pid for n, m in actuator._owned["interactive"].items()}
        # When the gateway restarts and forgets them, the next look registers them again
        before = dict(registry.registered)
        registry.registered.clear()
        await actuator.observe("interactive", None)
        assert registry.registered == before and actuator.reregistered == 2
        # When scaled down to 2, the newest is deregistered (drained) before it is stopped
        newest = max(pids, key=lambda n: int(n.rsplit("-", 1)[1]))
        await actuator.scale("interactive", 2)
        assert registry.log[-1] == ("deregister", newest)
        assert not alive(pids[newest]) and newest not in registry.registered
        # When the other one is replaced, a fresh process takes its place
        other = next(n for n in pids if n != newest)
        assert await actuator.replace("interactive", other)
        assert not await actuator.replace("interactive", "a-replica-from-the-fleet-config")
        assert not alive(pids[other])

        async def replaced() -> bool:
            return await actuator.observe("interactive", None) == PoolReplicas(2, 0)

        await until(replaced)
        (fresh,) = registry.registered
        assert fresh not in pids
        # When that process dies on its own, it no longer counts, and the next scale replaces it
        proc = actuator._owned["interactive"][fresh].proc
        proc.send_signal(9)
        await until(lambda: asyncio.sleep(0, result=not proc.running()))
        assert (await actuator.observe("interactive", None)).ready == 1
        await actuator.scale("interactive", 2)
        assert fresh not in registry.registered
        await until(replaced)
    finally:
        await actuator.aclose()
    assert registry.registered == {}
    assert actuator._owned["interactive"] == {}


async def test_a_replica_that_never_becomes_healthy_is_stopped_and_not_registered(tmp_path: Path) -> None:
    registry = Registry()
    actuator = LocalProcessActuator(
        {"interactive": LocalTemplate(kind="sim", preset="test", served_model_name="tiny")},
        registry=registry,
        factory=factory({"auto-interactive-0"}),  # type: ignore[arg-type]
        log_dir=tmp_path,
        ready_timeout_s=20,
    )
    try:
        await actuator.scale("interactive", 1)

        async def failed() -> bool:
            return actuator.failed_starts == 1

        await until(failed)
        assert registry.registered == {}
        assert await actuator.observe("interactive", None) == PoolReplicas(0, 0)
    finally:
        await actuator.aclose()


def test_templates_are_checked() -> None:
    with pytest.raises(ValueError):
        LocalTemplate(kind="sim", served_model_name="m")
    with pytest.raises(ValueError):
        LocalTemplate(kind="vllm", served_model_name="m")


async def test_a_replica_started_for_a_pool_whose_replicas_publish_kv_events_announces_its_own(
    tmp_path: Path,
) -> None:
    """A pool whose launched replicas publish KV events gets copies that publish too, on ports of
    their own, and register with where they publish, so the gateways follow them at once."""
    import zmq

    from tidal.replicas.wire.kv_events import decode_batch

    registry = Registry()
    template = LocalTemplate(kind="sim", preset="fast-test", served_model_name="m", kv_events=True)
    actuator = LocalProcessActuator(
        {"interactive": template}, registry=registry, log_dir=tmp_path, ready_timeout_s=60
    )
    try:
        await actuator.scale("interactive", 2)

        async def both_registered() -> bool:
            return len(registry.registered) == 2

        await until(both_registered, 60)
        specs = list(registry.kv_events.values())
        assert all(s is not None and s["endpoint"] and s["replay_endpoint"] for s in specs)
        assert len({s["endpoint"] for s in specs if s}) == 2  # each on its own port
        # What it announced is where it publishes: a request's blocks arrive there.
        name, (url, _, _) = next(iter(registry.registered.items()))
        spec = registry.kv_events[name]
        assert spec is not None and spec["endpoint"] is not None
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, (spec["topic"] or "").encode())
        sub.connect(spec["endpoint"])
        try:
            import httpx

            await asyncio.sleep(0.3)  # the subscription reaches the publisher
            async with httpx.AsyncClient() as http:
                r = await http.post(
                    url + "/v1/completions", json={"model": "m", "prompt": "a b c " * 40, "max_tokens": 1}
                )
                assert r.status_code == 200
            assert await asyncio.to_thread(sub.poll, 5000)
            *_, payload = sub.recv_multipart()
            batch, _ = decode_batch(payload)
            assert batch.events
        finally:
            sub.close(0)
    finally:
        await actuator.aclose()
