"""``tidal bench gate``: how fast the batch gate gets batch off the shared replicas in a spike.

Real processes on a real broker: ``--replicas`` simulated replicas (``tidal sim --preset
llama-3.1-8b-h100``, slowed down with ``--time-scale`` so that a step takes tens of milliseconds
and the whole setup fits a small machine) form an interactive pool with ``shared: true``; ``tidal
gateway`` serves it; a ``tidal worker --lane shared`` process sends batch lines to the same
replicas through RabbitMQ (the embedded broker when RabbitMQ is unreachable; the output says
so). The gate runs in this process, as the scheduler runs it: :class:`~scheduler.gate.BatchGate`
and :class:`~scheduler.gate.GateController` over :class:`~scheduler.gateway.GatewayAdmin` (the
gateway's ``/admin/load``) and :class:`~scheduler.lanes.SharedLane` over
:class:`~workers.control.LaneSwitch` (persisted lane state, the control fanout that aborts
in-flight lines, ``cancel_consumer`` confirmed).

First a few interactive-only spikes (no batch queued) give the baseline. Then batch saturates the
replicas (OpenAI batch files, topped up so work is always queued) and ``--spikes`` times an
interactive spike of closed-loop streams goes through the gateway, enough to push the gateway's
queue wait p95 over the gate's pause threshold. Times are from the **crossing** (the first
``/admin/load`` sample over the threshold, polled at 20 Hz, or the gate's own sample if earlier):

* (a) ``closed`` -- the gate's transition to paused;
* (b) ``last_dispatch`` -- the last batch request any replica received (the simulator counts
  requests by kind; batch lines carry ``X-Request-Id: batch-...``); 0 when none came after;
* (c) ``drained`` -- every shared replica has no batch sequence running or waiting (each
  replica's ``/metrics`` polled at 20 Hz).

Three runs in one invocation, each a series of the same spikes: **interactive only** (no batch
queued), **batch, gate on** (the gate as above), **batch, gate off** (the controller stopped and
the lane left open: the spike meets batch as it would without the gate). Each counts the streams
started from 3 s after the crossing (or after the spike's start when nothing crossed): TTFT and
TPOT of the admitted ones, and the attempts admission refused (a 429 when a stream would wait
past the interactive class's 2 s budget; a refused client retries after the ``Retry-After`` it
was given, as the OpenAI SDK does). The admitted TTFT alone cannot show interference, since the
budget bounds it; the refused count and TPOT can. The gate's value is the gate-off run minus the
gate-on run. Targets: drained p99 <= 0.5 s; the gate-on TTFT p95 within 1.25 x interactive
only's; the gate-off run measurably worse (TTFT or TPOT p95 past that bound, or ten points more
of its attempts refused). At the end every batch must complete with each line answered exactly
once (``lines_lost`` counts the others).

The batch is summaries (prompts of ~1,500 tokens, answers of 16-80), so that on a realistic
engine model (``llama-3.1-8b-h100``) its prefills and decodes share the steps of interactive
streams; a device with no compute cost would show no interference, with or without the gate.

Options: ``--spikes N`` (20), ``--replicas N`` (4), ``--baseline-spikes N`` (4), ``--off-spikes N``
(4), ``--streams N`` (interactive streams in a spike; default 7 per replica), ``--spike-s S``
(8), ``--preset NAME`` (``llama-3.1-8b-h100``), ``--time-scale X`` (0.2: a decode step of ~35 ms),
``--hold-s S`` (gate hold, 2). ``--quick``: 3 spikes, 2 of each other run.

Example::

    tidal bench gate --quick
    tidal bench gate --spikes 20 --replicas 4
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import socket
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tidal.batch_jobs import queries
from tidal.batch_jobs.dispatch import CeleryChunkPublisher, producer_app
from tidal.batch_jobs.files import file_store_from_settings
from tidal.batch_jobs.maintenance import BatchMaintenance
from tidal.batch_jobs.models import BatchCreate
from tidal.batch_jobs.service import BatchService
from tidal.batch_jobs.store import Store, worker_count
from tidal.clock import WallClock
from tidal.fleet import GateSpec, hash_api_key, parse_fleet
from tidal.priority.queues import Topology, declare_topology, delete_topology, is_amqp
from tidal.priority.window import quantile
from tidal.replicas.launcher import ReplicaProcess, free_port, sim_process
from tidal.replicas.wire.prom import parse_samples
from tidal.scheduler.gate import BatchGate, GateController, GateState, LaneAck, Transition
from tidal.scheduler.gateway import GatewayAdmin
from tidal.scheduler.lanes import SharedLane
from tidal.scheduler.signals import LoadReport
from tidal.settings import DEFAULT_BROKER_URL, Settings
from tidal.workers.control import LaneSwitch

__all__ = ["run"]

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-gate-key-0123456789abcdef"
ADMIN_KEY = "bench-gate-admin-0123456789abcdef"
MODEL = "sim"
POOL = "interactive"
POLL_S = 0.05  # 20 Hz: the replicas' metrics and the gateway's load
TTFT_AFTER_S = 3.0  # TTFT counts requests started this long after the crossing
TTFT_BOUND = 1.25  # the gate-on spike's TTFT p95 against interactive only's
DRAINED_P99_S = 0.5  # the crossing to no batch on any shared replica
WAIT_BUDGET_S = 2.0  # the interactive class's (the default): a longer wait is a 429


@dataclass
class _Opts:
    spikes: int
    replicas: int
    baseline_spikes: int
    streams: int
    spike_s: float
    time_scale: float
    hold_s: float
    preset: str = "llama-3.1-8b-h100"
    off_spikes: int = 2
    inflight_per_replica: int = 4
    batch_per_replica: int = 16
    chunk_lines: int = 16
    stream_tokens: int = 24
    line_tokens: int = 48  # the mean; each line draws 16 .. 2 x mean - 16, so lines end staggered
    line_prompt_words: int = 1500  # summaries: a long document in, a short answer out
    settle_s: float = 3.0  # batch runs this long after reaching every replica before a spike
    top_up_lines: int = 400


def _fleet(urls: list[str], o: _Opts) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "max_model_len": 32768}],
        "pools": {
            POOL: {
                "kind": "interactive",
                "model": MODEL,
                "shared": True,
                # A fixed admission cap, so that a spike of more streams queues in the gateway.
                "max_inflight_per_replica": o.inflight_per_replica,
                "min_inflight_per_replica": o.inflight_per_replica,
                "batch_concurrency_per_replica": o.batch_per_replica,
                "replicas": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(urls)],
            }
        },
        "classes": {
            "interactive": {"priority": 0, "wait_budget_s": WAIT_BUDGET_S, "tpot_slo_s": 0.05},
            "batch": {"priority": 100, "wait_budget_s": 3600.0, "tpot_slo_s": 1.0, "ttft_slo_s": 3600.0},
        },
        "features": {
            "default": {"class": "interactive", "context_cap": 32768},
            "batch": {"class": "batch", "context_cap": 32768},
        },
        "tenants": [{"name": "bench", "key_hashes": [hash_api_key(KEY)], "features": ["default"]}],
        "gateway": {"max_queue": 4096, "scrape_interval_s": 0.5},
        "gate": {
            "queue_wait_p95_pause_s": 0.5,
            "queue_wait_p95_resume_s": 0.1,
            "hold_s": o.hold_s,
            "sample_interval_s": 0.25,
        },
    }


def _broker() -> tuple[str, str | None]:
    """RabbitMQ when reachable, else the embedded broker, with what that costs."""
    url = os.environ.get("TIDAL_BROKER_URL", DEFAULT_BROKER_URL)
    parts = urllib.parse.urlsplit(url)
    if not is_amqp(url):
        return url, None
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=1.0):
            return url, None
    except OSError:
        note = (
            f"RabbitMQ is not reachable at {parts.hostname}:{parts.port or 5672}: the embedded broker is "
            "used, so a pause reaches the worker through the persisted lane state (polled every 2 s), "
            "not the control fanout"
        )
        return "filesystem://", note


# -- the processes ------------------------------------------------------------------------------


@dataclass
class _Setup:
    sims: list[ReplicaProcess]
    gateway: ReplicaProcess
    settings: Settings
    service: BatchService
    fleet: dict[str, Any]
    broker_note: str | None


@contextlib.contextmanager
def _processes(tmp: Path, o: _Opts) -> Iterator[_Setup]:
    broker, note = _broker()
    namespace = f"gate{secrets.token_hex(4)}"
    # Child processes run this checkout's code, whatever the environment has installed.
    pypath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with contextlib.ExitStack() as stack:
        sims = [
            sim_process(
                o.preset,
                name=f"gate-sim-{i}",
                args=["--served-model-name", MODEL, "--time-scale", str(o.time_scale)],
                log_path=tmp / f"sim-{i}.log",
                env={"PYTHONPATH": pypath},
            )
            for i in range(o.replicas)
        ]
        for s in sims:
            s.start()
            stack.callback(s.stop)
        for s in sims:
            s.wait_ready(120)
        fleet = _fleet([s.url for s in sims], o)
        fleet_path = tmp / "fleet.yaml"
        fleet_path.write_text(yaml.safe_dump(fleet))
        env = {
            "TIDAL_ENVIRONMENT": "test",
            "TIDAL_DATA_DIR": str(tmp / "data"),
            "TIDAL_BROKER_URL": broker,
            "TIDAL_BROKER_DIR": str(tmp / "data" / "broker"),
            "TIDAL_QUEUE_NAMESPACE": namespace,
            "TIDAL_FLEET_CONFIG": str(fleet_path),
            "TIDAL_CHUNK_LINES": str(o.chunk_lines),
            "TIDAL_ADMIN_KEY": ADMIN_KEY,
            "PYTHONPATH": pypath,
        }
        settings = Settings(
            _env_file=None,
            environment="test",
            data_dir=tmp / "data",
            broker_url=broker,
            broker_dir=tmp / "data" / "broker",
            queue_namespace=namespace,
            chunk_lines=o.chunk_lines,
        )
        if is_amqp(broker):
            declare_topology(broker, Topology(namespace))
            stack.callback(lambda: _quietly(delete_topology, broker, Topology(namespace)))
        publisher = CeleryChunkPublisher.from_settings(settings)
        stack.callback(publisher.close)
        service = BatchService(
            store=Store.from_url(settings.resolved_database_url),
            files=file_store_from_settings(settings),
            fleet=parse_fleet(fleet),
            settings=settings,
            publisher=publisher,
        )
        stack.callback(service.store.dispose)
        gw_port = free_port()
        gateway = ReplicaProcess(
            "gateway",
            [sys.executable, "-m", "tidal", "gateway", "--config", str(fleet_path), "--port", str(gw_port)],
            port=gw_port,
            env=env,
            log_path=tmp / "gateway.log",
            health_path="/healthz",
        )
        gateway.start()
        stack.callback(gateway.stop)
        # Enough chunks in flight to fill every replica's batch slots, and a few spare.
        concurrency = 2 * math.ceil(o.replicas * o.batch_per_replica / o.chunk_lines) + 2
        worker = ReplicaProcess(
            "worker",
            [
                sys.executable,
                "-m",
                "tidal",
                "--log-level",
                "WARNING",
                "worker",
                "--lane",
                "shared",
                "--concurrency",
                str(concurrency),
            ],
            port=0,
            env=env,
            log_path=tmp / "worker.log",
            cwd=ROOT,
        )
        worker.start()
        stack.callback(worker.stop)
        gateway.wait_ready(60)
        _wait_worker(settings, worker, 60)
        yield _Setup(sims, gateway, settings, service, fleet, note)


def _quietly(fn: Any, *args: Any) -> None:
    with contextlib.suppress(Exception):
        fn(*args)


def _wait_worker(settings: Settings, worker: ReplicaProcess, timeout: float) -> None:
    """Until the worker registered itself in the store (it does so before consuming)."""
    store = Store.from_url(settings.resolved_database_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if not worker.running():
                raise RuntimeError(f"the worker exited:\n{worker.log_tail()}")
            with contextlib.suppress(Exception), store.session() as s:
                n = worker_count(s)
                if n:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not register in {timeout:.0f} s:\n{worker.log_tail()}")
            time.sleep(0.2)
        if is_amqp(settings.broker_url):
            app = producer_app(settings)
            try:  # and answers remote control
                while not app.control.ping(timeout=0.5):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the worker does not answer remote control")
            finally:
                app.close()
    finally:
        store.dispose()


# -- what the benchmark watches -----------------------------------------------------------------


@dataclass
class _Watch:
    """20 Hz views of the replicas (batch running/waiting, last batch arrival) and the load."""

    replicas: list[tuple[float, int, float]] = field(default_factory=list)  # (t, batch active, last)
    load: list[tuple[float, float, float]] = field(default_factory=list)  # (t, queue wait p95, kv)
    gate_samples: list[tuple[float, float, float]] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    confirmed_pauses: list[float] = field(default_factory=list)
    batch_running: list[int] = field(default_factory=list)  # per replica, latest
    replica_polls: list[int] = field(default_factory=list)  # readings per replica
    started: float = field(default_factory=time.time)


class _RecordingSource:
    """The gate's load source, remembering when it saw what."""

    def __init__(self, inner: GatewayAdmin, watch: _Watch) -> None:
        self.inner = inner
        self.watch = watch

    async def load(self) -> LoadReport:
        report = await self.inner.load()
        p = report.pools.get(POOL)
        if p is not None:
            self.watch.gate_samples.append((time.time(), p.queue_wait_p95_s, p.kv_cache_usage_max))
        return report


class _RecordingLane:
    """The gate's lane controller, remembering when a pause was confirmed."""

    def __init__(self, inner: SharedLane, watch: _Watch) -> None:
        self.inner = inner
        self.watch = watch

    async def pause(self, pool: str, reason: str) -> LaneAck:
        ack = await self.inner.pause(pool, reason)
        if ack.confirmed:
            self.watch.confirmed_pauses.append(time.time())
        return ack

    async def resume(self, pool: str, reason: str) -> LaneAck:
        return await self.inner.resume(pool, reason)


_WANTED = ("tidal_sim_requests_running", "tidal_sim_requests_waiting", "tidal_sim_last_arrival")


async def _poll_replicas(session: aiohttp.ClientSession, urls: list[str], watch: _Watch) -> None:
    """Each replica on its own 20 Hz schedule (a slow one does not hold the others back); every
    reading adds a point with the latest view of all of them."""
    n = len(urls)
    active = [0] * n
    last = [0.0] * n
    watch.batch_running = [0] * n
    watch.replica_polls = [0] * n

    def poller(i: int) -> Callable[[], Awaitable[None]]:
        async def poll() -> None:
            t0 = time.time()
            async with session.get(urls[i] + "/metrics") as resp:
                body = await resp.text()
            # Only the few lines wanted are parsed: the page is long and read 20 times a second.
            wanted = "\n".join(ln for ln in body.splitlines() if ln.startswith(_WANTED))
            running = waiting = 0
            for smp in parse_samples(wanted):
                if smp.labels.get("kind") != "batch":
                    continue
                if smp.name == "tidal_sim_requests_running":
                    running = int(smp.value)
                elif smp.name == "tidal_sim_requests_waiting":
                    waiting = int(smp.value)
                elif smp.name == "tidal_sim_last_arrival_timestamp_seconds":
                    last[i] = smp.value
            active[i] = running + waiting
            watch.batch_running[i] = running
            watch.replica_polls[i] += 1
            watch.replicas.append((t0, sum(active), max(last)))

        return poll

    await asyncio.gather(*(_every(POLL_S, poller(i)) for i in range(n)))


async def _poll_load(admin: GatewayAdmin, watch: _Watch) -> None:
    async def poll() -> None:
        t0 = time.time()
        p = (await admin.load()).pools.get(POOL)
        if p is not None:
            watch.load.append((t0, p.queue_wait_p95_s, p.kv_cache_usage_max))

    await _every(POLL_S, poll)


async def _every(interval: float, fn: Callable[[], Awaitable[None]]) -> None:
    """Call ``fn`` on a fixed schedule (a failed call is skipped; an overrun restarts it)."""
    next_at = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            await fn()
        next_at += interval
        delay = next_at - time.monotonic()
        if delay < 0:
            next_at, delay = time.monotonic(), 0.0
        await asyncio.sleep(delay)


# -- the interactive spike ----------------------------------------------------------------------


@dataclass
class _Outcomes:
    """What the spike's clients saw: admitted streams (start, TTFT, TPOT) and refused attempts
    (start, status). A refused client waits for the ``Retry-After`` it was given (as the OpenAI
    SDK does) and tries again: the count says what admission turned away."""

    admitted: list[tuple[float, float, float | None]] = field(default_factory=list)
    refused: list[tuple[float, int]] = field(default_factory=list)

    def since(self, t: float) -> _Outcomes:
        return _Outcomes([a for a in self.admitted if a[0] >= t], [r for r in self.refused if r[0] >= t])

    def extend(self, other: _Outcomes) -> None:
        self.admitted += other.admitted
        self.refused += other.refused


async def _stream_client(
    session: aiohttp.ClientSession,
    url: str,
    tokens: int,
    until: float,
    out: _Outcomes,
    w: int,
) -> None:
    i = 0
    while time.time() < until:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"spike client {w} request {i} {secrets.token_hex(4)}"}],
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
        }
        i += 1
        t0 = time.time()
        first: float | None = None
        last = t0
        n = 0
        try:
            async with session.post(
                url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
            ) as resp:
                if resp.status != 200:
                    await resp.read()
                    out.refused.append((t0, resp.status))
                    # Back off as the OpenAI SDK does: for the Retry-After the gateway gave.
                    await asyncio.sleep(_retry_after(resp.headers.get("Retry-After"), until))
                    continue
                async for line in resp.content:
                    # One token per content event (ignore_eos, one choice); the role event and
                    # the final empty delta carry no token.
                    if line.startswith(b"data: {") and b'"content":"' in line.replace(b'"content":""', b""):
                        last = time.time()
                        n += 1
                        if first is None:
                            first = last
        except (aiohttp.ClientError, TimeoutError):
            out.refused.append((t0, 0))
            await asyncio.sleep(0.05)
            continue
        if first is not None:
            out.admitted.append((t0, first - t0, (last - first) / (n - 1) if n > 1 else None))


def _retry_after(header: str | None, until: float) -> float:
    try:
        wait = float(header) if header else 0.05
    except ValueError:
        wait = 0.05
    return max(0.0, min(wait, until - time.time()))


async def _spike(session: aiohttp.ClientSession, url: str, o: _Opts) -> tuple[float, _Outcomes]:
    start = time.time()
    out = _Outcomes()
    until = start + o.spike_s
    await asyncio.gather(
        *(_stream_client(session, url, o.stream_tokens, until, out, w) for w in range(o.streams))
    )
    return start, out


def _crossing(watch: _Watch, start: float, spec: GateSpec) -> float | None:
    over = [
        t
        for t, qw, kv in [*watch.load, *watch.gate_samples]
        if t >= start and (qw >= spec.queue_wait_p95_pause_s or kv >= spec.kv_usage_pause)
    ]
    return min(over) if over else None


async def _until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


async def _calm(watch: _Watch, spec: GateSpec, timeout: float = 60.0) -> None:
    """Until the gateway's queue wait p95 is back under the resume threshold."""

    def calm() -> bool:
        return bool(watch.load) and watch.load[-1][1] <= spec.queue_wait_p95_resume_s

    await _until(calm, timeout, "the interactive load to calm down")


# -- the batch ----------------------------------------------------------------------------------


def _submit(service: BatchService, n: int, o: _Opts, tag: str) -> str:
    rng = random.Random(tag)
    lo = min(16, o.line_tokens)
    lines = [
        (
            json.dumps(
                {
                    "custom_id": f"{tag}-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "model": MODEL,
                        "prompt": f"{tag} line {i}:" + " the" * o.line_prompt_words,
                        "max_tokens": rng.randint(lo, 2 * o.line_tokens - lo),
                        "ignore_eos": True,
                    },
                }
            )
            + "\n"
        ).encode()
        for i in range(n)
    ]
    f = service.save_generated_file("bench", filename=f"{tag}.jsonl", purpose="batch", lines=lines)
    batch = service.create_batch(
        "bench", BatchCreate(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    )
    return batch.id


def _pending(service: BatchService) -> int:
    with service.store.session() as s:
        return queries.pending_line_count(s)


def _lost(
    service: BatchService, batches: dict[str, tuple[str, int]], timeout: float
) -> tuple[int, list[str]]:
    """Wait for every batch to end; count lines not answered exactly once (output + error files)."""
    sweeper = BatchMaintenance(service.store, service.files, clock=service.clock)
    deadline = time.monotonic() + timeout
    lost = 0
    statuses: list[str] = []
    for batch_id, (tag, n) in batches.items():
        while True:
            b = service.get_batch("bench", batch_id)
            if b.status in ("completed", "failed", "expired", "cancelled"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} not final after {timeout:.0f} s")
            sweeper.sweep()
            time.sleep(0.2)
        statuses.append(b.status)
        seen: dict[str, int] = {}
        for file_id in (b.output_file_id, b.error_file_id):
            if file_id is None:
                continue
            with service.open_file("bench", file_id) as fh:
                for raw in fh:
                    if raw.strip():
                        cid = str(json.loads(raw).get("custom_id"))
                        seen[cid] = seen.get(cid, 0) + 1
        answered_once = sum(1 for i in range(n) if seen.get(f"{tag}-{i}") == 1)
        lost += n - answered_once
    return lost, statuses


# -- the run ------------------------------------------------------------------------------------


def _p(values: list[float], q: float) -> float | None:
    v = [x for x in values if math.isfinite(x)]
    return quantile(v, q) if v else None


def _phase(name: str, spikes: int, out: _Outcomes) -> dict[str, Any]:
    """One run's figures over its admitted streams, and what admission refused meanwhile."""
    ttft = [a[1] for a in out.admitted]
    tpot = [a[2] for a in out.admitted if a[2] is not None]
    refused = len(out.refused)
    attempts = refused + len(ttft)
    return {
        "phase": name,
        "spikes": spikes,
        "admitted": len(ttft),
        "refused": refused,
        "refused_429": sum(1 for _, status in out.refused if status == 429),
        "refused_share": refused / attempts if attempts else None,
        "ttft_p50_s": _p(ttft, 0.5),
        "ttft_p95_s": _p(ttft, 0.95),
        "tpot_p50_s": _p(tpot, 0.5),
        "tpot_p95_s": _p(tpot, 0.95),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


async def _bench(setup: _Setup, o: _Opts, log: Any) -> dict[str, Any]:
    spec = GateSpec.model_validate(setup.fleet["gate"])
    watch = _Watch()
    clock = WallClock()
    switch = LaneSwitch(setup.settings)
    lane = SharedLane(switch)
    admin = GatewayAdmin([setup.gateway.url], admin_key=ADMIN_KEY)
    poll_admin = GatewayAdmin([setup.gateway.url], admin_key=ADMIN_KEY)
    # Spikes here are made by the benchmark, not by the batch load: a re-pause soon after a
    # resume must not double the hold (the flap guard), or the cycles would grow ever longer.
    gate = BatchGate(POOL, spec, clock=clock, flap_window_s=0.0)
    controller = GateController(
        [gate],
        source=_RecordingSource(admin, watch),
        lane=_RecordingLane(lane, watch),
        clock=clock,
        on_transition=watch.transitions.append,
    )
    gate_stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    connector = aiohttp.TCPConnector(limit=o.streams * 2 + 16)
    batches: dict[str, tuple[str, int]] = {}

    def top_up() -> None:
        if _pending(setup.service) < o.top_up_lines:
            tag = f"b{len(batches)}"
            batches[_submit(setup.service, o.top_up_lines, o, tag)] = (tag, o.top_up_lines)

    def batch_everywhere() -> bool:
        return len(watch.batch_running) == o.replicas and all(r > 0 for r in watch.batch_running)

    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        try:
            gate_task = asyncio.create_task(controller.run(gate_stop))
            tasks.append(gate_task)
            tasks.append(asyncio.create_task(_poll_replicas(session, [s.url for s in setup.sims], watch)))
            tasks.append(asyncio.create_task(_poll_load(poll_admin, watch)))
            gw = setup.gateway.url

            # 1. Interactive only: the same spikes with no batch at all.
            base = _Outcomes()
            for k in range(o.baseline_spikes):
                await _calm(watch, spec)
                start, out = await _spike(session, gw, o)
                cross = _crossing(watch, start, spec)
                ref = cross if cross is not None else start
                base.extend(out.since(ref + TTFT_AFTER_S))
                log(
                    f"interactive only, spike {k + 1}/{o.baseline_spikes}: crossing +{_fmt(cross, start)} s, "
                    f"{len(out.admitted)} streams, {len(out.refused)} refused"
                )

            # 2. Batch on the shared replicas, the gate on.
            closed: list[float] = []
            confirmed: list[float] = []
            last_dispatch: list[float] = []
            drained: list[float] = []
            gate_on = _Outcomes()
            per_spike: list[dict[str, Any]] = []
            for k in range(o.spikes):
                top_up()
                # The gate open and batch running on every shared replica before the spike.
                await _until(
                    lambda: (
                        gate.state is GateState.OPEN
                        and controller.applied[POOL] is GateState.OPEN
                        and batch_everywhere()
                    ),
                    120,
                    "batch running on every shared replica with the gate open",
                )
                # Lines end and start at staggered times by now, as in a pool busy with batch.
                await asyncio.sleep(o.settle_s)
                await _calm(watch, spec)
                start, out = await _spike(session, gw, o)
                cross = _crossing(watch, start, spec)
                if cross is None:
                    log(f"spike {k + 1}: the queue wait never crossed the threshold")
                    per_spike.append({"spike": k + 1, "crossing": None})
                    continue
                tr = next(
                    (t.at for t in watch.transitions if t.to is GateState.PAUSED and t.at >= start - 0.25),
                    math.inf,
                )
                conf = next((t for t in watch.confirmed_pauses if t >= start - 0.25), math.inf)
                dr = next((t for t, active, _ in watch.replicas if t >= cross and active == 0), math.inf)
                last = max((x for t, _, x in watch.replicas if t <= start + o.spike_s), default=0.0)
                active_at = [a for t, a, _ in watch.replicas if t <= cross]
                closed.append(tr - cross)
                confirmed.append(conf - cross)
                last_dispatch.append(max(0.0, last - cross))
                drained.append(dr - cross)
                per_spike.append(
                    {
                        "spike": k + 1,
                        "batch_active_at_crossing": active_at[-1] if active_at else None,
                        "closed_s": closed[-1],
                        "confirmed_s": confirmed[-1],
                        "last_dispatch_s": last_dispatch[-1],
                        "drained_s": drained[-1],
                    }
                )
                gate_on.extend(out.since(cross + TTFT_AFTER_S))
                log(
                    f"batch, gate on, spike {k + 1}/{o.spikes}: closed {closed[-1]:.3f} s, lane confirmed "
                    f"{confirmed[-1]:.3f} s, last batch dispatch {last_dispatch[-1]:.3f} s, "
                    f"drained {drained[-1]:.3f} s; {len(out.refused)} refused"
                )

            # 3. Batch on the shared replicas, the gate off: the controller stops and the lane
            # stays open whatever the load, so the spike meets batch as it would without Tidal.
            gate_stop.set()
            await gate_task
            await lane.resume(POOL, "benchmark: gate off")
            gate_off = _Outcomes()
            batch_during_off: list[int] = []
            for k in range(o.off_spikes):
                top_up()
                await _until(batch_everywhere, 120, "batch running on every shared replica")
                await asyncio.sleep(o.settle_s)
                await _calm(watch, spec)
                start, out = await _spike(session, gw, o)
                cross = _crossing(watch, start, spec)
                ref = (cross if cross is not None else start) + TTFT_AFTER_S
                gate_off.extend(out.since(ref))
                # Batch really stayed on the replicas through the measured part of the spike.
                during = [a for t, a, _ in watch.replicas if ref <= t <= start + o.spike_s]
                batch_during_off.append(min(during) if during else 0)
                log(
                    f"batch, gate off, spike {k + 1}/{o.off_spikes}: crossing +{_fmt(cross, start)} s, "
                    f"batch sequences on the replicas >= {batch_during_off[-1]}, "
                    f"{len(out.refused)} refused"
                )
            # The batches finish, then every line is checked.
            lost, statuses = await asyncio.to_thread(_lost, setup.service, batches, 600.0)
        finally:
            gate_stop.set()
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t
            await admin.aclose()
            await poll_admin.aclose()
            switch.close()
    # The slowest replica's reading rate over the whole run.
    poll_hz = min(watch.replica_polls) / (time.time() - watch.started) if watch.replica_polls else None
    phases = [
        _phase("interactive only", o.baseline_spikes, base),
        _phase("batch, gate on", len(drained), gate_on),
        _phase("batch, gate off", o.off_spikes, gate_off),
    ]
    only, on, off = phases
    drained_p99 = _p(drained, 0.99)
    on_ttft_ratio = _ratio(on["ttft_p95_s"], only["ttft_p95_s"])
    off_ttft_ratio = _ratio(off["ttft_p95_s"], only["ttft_p95_s"])
    off_tpot_ratio = _ratio(off["tpot_p95_s"], only["tpot_p95_s"])
    # "Measurably worse": the gate-off run misses the bound the gate-on run must meet, on TTFT
    # or TPOT p95 of what was admitted, or admission refused ten points more of its attempts.
    off_worse = (
        (off_ttft_ratio or 0.0) > TTFT_BOUND
        or (off_tpot_ratio or 0.0) > TTFT_BOUND
        or (off["refused_share"] or 0.0) >= (only["refused_share"] or 0.0) + 0.10
    )

    def diff(key: str) -> float | None:
        return off[key] - on[key] if off[key] is not None and on[key] is not None else None

    return {
        "closed_p50_s": _p(closed, 0.5),
        "closed_p99_s": _p(closed, 0.99),
        "last_dispatch_p99_s": _p(last_dispatch, 0.99),
        "drained_p50_s": _p(drained, 0.5),
        "drained_p99_s": drained_p99,
        "ttft_p95_spike_s": on["ttft_p95_s"],
        "ttft_p95_baseline_s": only["ttft_p95_s"],
        "lines_lost": lost,
        "spikes": len(drained),
        # Extras: the three runs, the gate's value, the targets, and how the run was set up.
        "ttft_p95_gate_off_s": off["ttft_p95_s"],
        "tpot_p95_baseline_s": only["tpot_p95_s"],
        "tpot_p95_spike_s": on["tpot_p95_s"],
        "tpot_p95_gate_off_s": off["tpot_p95_s"],
        "phases": phases,
        "gate_value": {
            "ttft_p95_s": diff("ttft_p95_s"),
            "tpot_p95_s": diff("tpot_p95_s"),
            "refused": off["refused"] - on["refused"],
            "refused_share": diff("refused_share"),
        },
        "overflow": "none: the fleet has no external provider, so every refusal is a 429",
        "confirmed_p50_s": _p(confirmed, 0.5),
        "confirmed_p99_s": _p(confirmed, 0.99),
        "last_dispatch_p50_s": _p(last_dispatch, 0.5),
        "ttft_ratio": on_ttft_ratio,
        "ttft_ratio_gate_off": off_ttft_ratio,
        "tpot_ratio_gate_off": off_tpot_ratio,
        "target_drained_p99_s": DRAINED_P99_S,
        "target_ttft_ratio": TTFT_BOUND,
        "drained_target_met": drained_p99 is not None and drained_p99 <= DRAINED_P99_S,
        "ttft_target_met": on_ttft_ratio is not None and on_ttft_ratio <= TTFT_BOUND,
        "gate_off_worse": off_worse,
        "batch_during_gate_off_min": min(batch_during_off, default=0),
        "spikes_requested": o.spikes,
        "baseline_spikes": o.baseline_spikes,
        "off_spikes": o.off_spikes,
        "ttft_requests_spike": on["admitted"],
        "ttft_requests_baseline": only["admitted"],
        "batch_lines": sum(n for _, n in batches.values()),
        "batch_statuses": sorted(set(statuses)),
        "replicas": o.replicas,
        "setup": (
            f"{o.replicas} x tidal sim {o.preset} at time scale {o.time_scale:g}; gateway cap "
            f"{o.inflight_per_replica}/replica, {o.streams} spike streams of {o.stream_tokens} tokens for "
            f"{o.spike_s:g} s; batch {o.batch_per_replica} lines/replica of ~{o.line_prompt_words} prompt and "
            f"{o.line_tokens} output tokens; "
            f"gate pause at queue wait p95 {spec.queue_wait_p95_pause_s} s, hold {spec.hold_s:g} s; "
            f"interactive wait budget {WAIT_BUDGET_S:g} s"
        ),
        "broker": "rabbitmq" if is_amqp(setup.settings.broker_url) else "embedded",
        "replica_polls_per_s": poll_hz,  # how often every replica's batch count was read (aim: 20)
        "per_spike": per_spike,
    }


def _fmt(t: float | None, start: float) -> str:
    return f"{t - start:.2f}" if t is not None else "never"


def run(
    quick: bool,
    out_dir: Path,
    spikes: str | int | None = None,
    replicas: str | int = 4,
    baseline_spikes: str | int | None = None,
    off_spikes: str | int | None = None,
    streams: str | int | None = None,
    spike_s: str | float = 8.0,
    time_scale: str | float = 0.2,
    preset: str = "llama-3.1-8b-h100",
    hold_s: str | float = 2.0,
    **_: Any,
) -> dict[str, Any]:
    """The contract's keys (see the module docstring), plus extras and per-spike rows."""
    from tidal.cli.bench import print_table

    n_replicas = int(replicas)
    o = _Opts(
        spikes=int(spikes) if spikes is not None else (3 if quick else 20),
        replicas=n_replicas,
        baseline_spikes=int(baseline_spikes) if baseline_spikes is not None else (2 if quick else 4),
        off_spikes=int(off_spikes) if off_spikes is not None else (2 if quick else 4),
        streams=int(streams) if streams is not None else 7 * n_replicas,
        spike_s=float(spike_s),
        time_scale=float(time_scale),
        hold_s=float(hold_s),
        preset=preset,
    )
    with (
        tempfile.TemporaryDirectory(prefix="tidal-bench-gate-") as tmpdir,
        _processes(Path(tmpdir), o) as setup,
    ):
        print(f"broker: {setup.broker_note or 'RabbitMQ'}")
        result = asyncio.run(_bench(setup, o, lambda m: print(m, flush=True)))

    def ms(v: Any) -> str:
        return f"{v * 1000:.0f}" if isinstance(v, float) and math.isfinite(v) else "-"

    def signed_ms(v: Any) -> str:
        return f"{v * 1000:+.0f} ms" if isinstance(v, float) and math.isfinite(v) else "-"

    def pct(v: Any) -> str:
        return f"{100 * v:.1f}" if isinstance(v, float) else "-"

    def signed_pct(v: Any) -> str:
        return f"{100 * v:+.1f} points" if isinstance(v, float) else "-"

    def ratio(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else "-"

    print()
    print_table(
        [
            {
                "from the crossing to": "(a) gate closed",
                "p50_ms": ms(result["closed_p50_s"]),
                "p99_ms": ms(result["closed_p99_s"]),
            },
            {
                "from the crossing to": "    lane confirmed",
                "p50_ms": ms(result["confirmed_p50_s"]),
                "p99_ms": ms(result["confirmed_p99_s"]),
            },
            {
                "from the crossing to": "(b) last batch dispatch",
                "p50_ms": ms(result["last_dispatch_p50_s"]),
                "p99_ms": ms(result["last_dispatch_p99_s"]),
            },
            {
                "from the crossing to": "(c) batch drained",
                "p50_ms": ms(result["drained_p50_s"]),
                "p99_ms": ms(result["drained_p99_s"]),
            },
        ]
    )
    print()
    print_table(
        [
            {
                "run": ph["phase"],
                "spikes": ph["spikes"],
                "admitted": ph["admitted"],
                "refused_429": ph["refused_429"],
                "refused_other": ph["refused"] - ph["refused_429"],
                "refused_%": pct(ph["refused_share"]),
                "ttft_p50_ms": ms(ph["ttft_p50_s"]),
                "ttft_p95_ms": ms(ph["ttft_p95_s"]),
                "tpot_p95_ms": ms(ph["tpot_p95_s"]),
            }
            for ph in result["phases"]
        ]
    )
    value = result["gate_value"]
    print(
        f"\nthe gate's value (gate off - gate on): TTFT p95 {signed_ms(value['ttft_p95_s'])}, "
        f"TPOT p95 {signed_ms(value['tpot_p95_s'])}, refused {value['refused']:+d} "
        f"({signed_pct(value['refused_share'])} of attempts)"
    )
    print()
    print_table(
        [
            {
                "drained_p99<=500ms": result["drained_target_met"],
                "lines_lost": result["lines_lost"],
                "gate_on_ttft_ratio": ratio(result["ttft_ratio"]),
                "gate_on_within_1.25x": result["ttft_target_met"],
                "gate_off_ttft_ratio": ratio(result["ttft_ratio_gate_off"]),
                "gate_off_tpot_ratio": ratio(result["tpot_ratio_gate_off"]),
                "gate_off_worse": result["gate_off_worse"],
            }
        ]
    )
    hz = result["replica_polls_per_s"]
    print(f"\n{result['setup']}; broker {result['broker']}; replicas polled at {hz or 0:.1f} Hz")
    return result
