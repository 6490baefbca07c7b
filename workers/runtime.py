"""What one worker process holds: the store, the event loop that sends lines, the replica pools
per lane, the middleware, the lane gate and its listeners, and the chunk task's logic.

Lanes and replicas (the fleet's pools):

=========  ===================================  =============================================
lane       sends to                             consumes
=========  ===================================  =============================================
reserved   pools of kind ``batch``              ``<ns>.reserved`` then ``<ns>.shared``
spot       pools of kind ``spot``               ``<ns>.spot`` then ``<ns>.shared``
shared     ``interactive`` pools with           ``<ns>.shared`` (paused by the scheduler's
           ``shared: true``                     gate when users need the capacity)
all        the chunk's own lane (``tidal up``:  every queue
           one light process for the laptop)
=========  ===================================  =============================================

A batch pinned to a ``pool`` or ``replica_group`` (admins, e.g. a canary eval) goes to those
replicas whatever the lane. A batch whose feature lists ``regions`` goes only to pools in those
regions (:func:`chunk_pools`); with none at hand its chunk waits in the queue.

A pool's replicas are those of the fleet file plus those registered with the gateway at run time
(``POST /admin/replicas``: the autoscaler's local actuator, a canary roll-out), which the gateway
records in the store; a worker re-reads them at most every ``RUNTIME_REPLICAS_TTL_S`` seconds, so
a replica added to a shared pool takes batch work within seconds, and one being removed takes no
new lines once its record is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
from celery.exceptions import Reject
from sqlmodel import select

from tidal.batch_jobs import queries
from tidal.batch_jobs.dispatch import ChunkPublisher, top_up
from tidal.batch_jobs.files import file_store_from_settings
from tidal.batch_jobs.finalize import finalize_batch
from tidal.batch_jobs.jobs import JobService
from tidal.batch_jobs.maintenance import BatchMaintenance
from tidal.batch_jobs.models import BatchRecord
from tidal.batch_jobs.results import LineResult, record_results
from tidal.batch_jobs.service import BatchService
from tidal.batch_jobs.store import Store, lane_states, register_worker, runtime_replicas, unregister_worker
from tidal.clock import WallClock
from tidal.fleet import FleetConfig, PoolSpec, ReplicaSpec
from tidal.priority.classes import Lane, lane_pools
from tidal.priority.queues import LANES, Topology, is_amqp, parse_lane_control, pika_parameters
from tidal.replicas.client import ReplicaClient
from tidal.settings import Settings
from tidal.workers.chunk import ChunkExecutor, ChunkOutcome, ChunkWork, PendingLine, ReplicaSet, ReplicaSlot
from tidal.workers.middleware import (
    AccessLog,
    BatchClosed,
    ChunkMiddleware,
    LaneGate,
    LanePause,
    Metrics,
    Preemption,
    PriorityMapping,
    Retries,
    TimeLimit,
)

__all__ = [
    "WORKER_LANES",
    "WorkerRuntime",
    "chunk_pools",
    "lane_of_hostname",
    "lane_pools",
    "worker_hostname",
]

log = logging.getLogger(__name__)

WORKER_LANES = ("reserved", "spot", "shared", "all")
HOUSEKEEPING_S = 2.0
HEARTBEAT_EVERY_S = 5.0
PAUSE_REQUEUE_DELAY_S = 0.5
NO_REPLICA_RETRY_S = 5.0  # a paused chunk waits a moment so it does not bounce straight back
RUNTIME_REPLICAS_TTL_S = 2.0  # how stale the list of replicas registered at run time may be


async def _close_when_idle(slot: ReplicaSlot, poll_s: float = 0.5) -> None:
    """Close a dropped replica's connections once its last line there has finished."""
    while slot.inflight > 0:
        await asyncio.sleep(poll_s)
    await slot.client.aclose()


def worker_hostname(lane: str) -> str:
    """``<lane>@<host>-<pid>``: the lane is readable from the Celery node name."""
    return f"{lane}@{socket.gethostname()}-{os.getpid()}"


def lane_of_hostname(hostname: str) -> str:
    return hostname.split("@", 1)[0]


def chunk_pools(
    fleet: FleetConfig,
    *,
    lane: str,
    worker_lane: str,
    pool: str | None = None,
    model: str | None = None,
    regions: frozenset[str] | None = None,
) -> list[PoolSpec]:
    """The pools a chunk of ``lane`` is sent to by a worker of ``worker_lane``: the batch's pinned
    ``pool``, else the lane's pools (an ``all`` worker borrows another lane's when its fleet has
    none), those serving ``model`` first; never a pool outside ``regions`` (its feature's)."""

    def inside(candidates: list[PoolSpec]) -> list[PoolSpec]:
        return [p for p in candidates if regions is None or (p.region is not None and p.region in regions)]

    if pool is not None:
        pools = inside([fleet.pools[pool]] if pool in fleet.pools else [])
    else:
        pools = inside(lane_pools(fleet, lane))
        if not pools and worker_lane == "all":
            # A laptop fleet without that lane's pools: borrow the first lane that has some.
            pools = next((p for p in (inside(lane_pools(fleet, x)) for x in LANES) if p), [])
    if model is not None:
        # Prefer the pools that serve the batch's model (or the base of its adapter).
        adapter = fleet.adapter(model)
        base = adapter.base_model if adapter else model
        pools = [p for p in pools if p.model == base] or pools
    return pools


def governed_queues(worker_lane: str, paused_lane: str) -> list[str]:
    """Lanes (queues) a worker stops consuming when ``paused_lane`` pauses."""
    if worker_lane == "all":
        return [paused_lane]
    if worker_lane == paused_lane:
        return [paused_lane] if worker_lane == Lane.SHARED else [worker_lane, Lane.SHARED.value]
    return []


@dataclass
class _Plan:
    lane: str
    replicas: list[tuple[PoolSpec, ReplicaSpec]]


class WorkerRuntime:
    """Everything the chunk task needs in one process; ``start()`` before the Celery worker runs."""

    current: WorkerRuntime | None = None

    def __init__(
        self,
        *,
        settings: Settings,
        fleet: FleetConfig,
        lane: str,
        concurrency: int,
        hostname: str | None = None,
        publisher: ChunkPublisher | None = None,
    ) -> None:
        if lane not in WORKER_LANES:
            raise ValueError(f"lane must be one of {', '.join(WORKER_LANES)}")
        self.settings = settings
        self.fleet = fleet
        self.lane = lane
        self.concurrency = concurrency
        self.hostname = hostname or worker_hostname(lane)
        self.topology = Topology(settings.queue_namespace)
        self.store = Store.from_url(settings.resolved_database_url)
        self.files = file_store_from_settings(settings)
        self.clock = WallClock()
        self.batch_service = BatchService(
            store=self.store,
            files=self.files,
            fleet=fleet,
            settings=settings,
            publisher=publisher,
            clock=self.clock,
        )
        self.jobs = JobService(self.batch_service)
        self.publisher = publisher
        self.gate = LaneGate()
        self.preemption = Preemption(grace_s=max(0.0, settings.soft_shutdown_s - 3.0))
        self.metrics = Metrics()
        self.middleware: list[ChunkMiddleware] = [
            AccessLog(),  # first: its after_request sees what the others made of the attempt
            self.metrics,
            PriorityMapping(),
            Retries(),
            TimeLimit(settings.chunk_time_limit_s),
            LanePause(self.gate),
            self.preemption,
            BatchClosed(self._batch_open),
        ]
        self.executor = ChunkExecutor(self.middleware)
        self.maintenance = BatchMaintenance(
            self.store,
            self.files,
            clock=self.clock,
            publisher=publisher,
            after_final=self.jobs.after_final,
            republish_stale_running_after_s=None if is_amqp(settings.broker_url) else 120.0,
            windows=self.batch_service.windows,
            extra_steps=[self.jobs.advance_stuck],
        )
        self.consumer: Any = None  # Celery's consumer, set when the worker is ready
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="tidal-chunks", daemon=True)
        # (lane, pools, group) -> its replica set: batches of different models use different pools
        self._replica_sets: dict[tuple[str, tuple[str, ...], str | None], ReplicaSet] = {}
        self._runtime_lock = threading.Lock()
        self._runtime: dict[str, list[ReplicaSpec]] = {}  # pool -> replicas registered at run time
        self._runtime_read_at = -math.inf
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._consuming_paused: set[str] = set()
        self._last_heartbeat = 0.0
        # Lanes where a chunk finished since the last top-up (see _top_up_loop).
        self._finished_lanes: set[str] = set()
        self._finished_lock = threading.Lock()
        self._finished = threading.Event()
        for name in [lane] if lane != "all" else []:
            if not lane_pools(fleet, name):
                raise ValueError(f"the fleet has no replicas for lane {name!r} (pools of that kind)")

    # -- lifecycle ------------------------------------------------------------------------------

    def queues(self) -> list[str]:
        """Queue names to consume at start, leaving out lanes whose gate is paused."""
        lanes = [lane.value for lane in LANES] if self.lane == "all" else [self.lane]
        if self.lane in (Lane.RESERVED, Lane.SPOT):
            lanes.append(Lane.SHARED.value)
        paused = {lane for lane, p in self.gate.snapshot().items() if p}
        skipped = {q for p in paused for q in governed_queues(self.lane, p)}
        self._consuming_paused = skipped & set(lanes)
        return [self.topology.queue(lane) for lane in lanes if lane not in skipped]

    def start(self) -> None:
        WorkerRuntime.current = self
        self._loop_thread.start()
        with self.store.session() as s:
            for lane, paused in lane_states(s).items():
                self.gate.apply(lane, paused, "persisted state at start")
            register_worker(
                s, hostname=self.hostname, lane=self.lane, pid=os.getpid(), concurrency=self.concurrency
            )
        self.gate.listeners.append(self._on_gate_change)
        self._spawn(self._housekeeping, "tidal-housekeeping")
        if self.publisher is not None:
            self._spawn(self._top_up_loop, "tidal-top-up")
        if is_amqp(self.settings.broker_url):
            self._spawn(self._listen_control, "tidal-lane-control")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def on_ready(self, consumer: Any) -> None:
        self.consumer = consumer

    def on_shutdown(self) -> None:
        """SIGTERM (spot notice) or Ctrl-C: running chunks stop sending and requeue the rest."""
        log.warning(
            "worker %s shutting down: running chunks save progress and requeue the rest", self.hostname
        )
        self.preemption.preempt()

    def close(self) -> None:
        self._closing.set()
        for t in self._threads:
            t.join(10)  # a sweep in progress finishes before the store closes
        with contextlib.suppress(Exception), self.store.session() as s:
            unregister_worker(s, self.hostname)
        for rs in list(self._replica_sets.values()):
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(rs.aclose(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(5)
        self.store.dispose()
        if WorkerRuntime.current is self:
            WorkerRuntime.current = None

    # -- the lane gate --------------------------------------------------------------------------

    def _on_gate_change(self, lane: str, paused: bool) -> None:
        """Also stop/start consuming the governed queues ourselves, so a pause holds even for a
        worker the scheduler's cancel_consumer did not reach."""
        consumer = self.consumer
        for q in governed_queues(self.lane, lane):
            name = self.topology.queue(q)
            if paused and q not in self._consuming_paused:
                self._consuming_paused.add(q)
                if consumer is not None:
                    consumer.call_soon(consumer.cancel_task_queue, name)
            elif not paused and q in self._consuming_paused:
                self._consuming_paused.discard(q)
                if consumer is not None:
                    consumer.call_soon(consumer.add_task_queue, name)
        try:
            self._register()  # report the new view at once: LaneSwitch may be waiting on it
        except Exception:
            log.exception("could not record the lane state of %s", self.hostname)

    def _listen_control(self) -> None:
        """Hear pause/resume on the ``<ns>.control`` fanout (reconnecting if the broker goes)."""
        while not self._closing.is_set():
            try:
                conn = pika.BlockingConnection(pika_parameters(self.settings.broker_url))
                try:
                    ch = conn.channel()
                    ch.exchange_declare(self.topology.control_exchange, exchange_type="fanout", durable=True)
                    q = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
                    ch.queue_bind(q, self.topology.control_exchange)
                    for _method, _props, body in ch.consume(q, auto_ack=True, inactivity_timeout=1.0):
                        if self._closing.is_set():
                            break
                        if body is None:
                            continue
                        msg = parse_lane_control(body)
                        if msg is not None:
                            self.gate.apply(msg.lane, msg.action == "pause", f"control message {msg.id}")
                finally:
                    with contextlib.suppress(Exception):
                        conn.close()
            except Exception as exc:
                log.debug("lane control listener: %r; reconnecting", exc)
                self._closing.wait(1.0)

    def _housekeeping(self) -> None:
        """Heartbeat, persisted lane state (a backstop for missed control messages), and the
        maintenance sweep (finalisation nobody finished, expiry, cancellations)."""
        while not self._closing.wait(HOUSEKEEPING_S):
            try:
                with self.store.session() as s:
                    states = lane_states(s)
                    if time.time() - self._last_heartbeat >= HEARTBEAT_EVERY_S:
                        register_worker(
                            s,
                            hostname=self.hostname,
                            lane=self.lane,
                            pid=os.getpid(),
                            concurrency=self.concurrency,
                        )
                        self._last_heartbeat = time.time()
                for lane, paused in states.items():
                    self.gate.apply(lane, paused, "persisted state")
                self.maintenance.sweep()
            except Exception:
                log.exception("worker housekeeping failed")

    def _chunk_finished(self, lane: str) -> None:
        """A chunk of ``lane`` left the broker for good: its tenant's window has room again."""
        with self._finished_lock:
            self._finished_lanes.add(lane)
        self._finished.set()

    def _top_up_loop(self) -> None:
        """Top up the tenants' windows of the lanes where chunks finished, off the chunk threads
        (a chunk's message is acknowledged without waiting for it) and one pass for a burst of
        finished chunks; the maintenance sweep tops up too, should this miss one."""
        assert self.publisher is not None
        while not self._closing.is_set():
            if not self._finished.wait(0.5):
                continue
            self._finished.clear()
            with self._finished_lock:
                lanes, self._finished_lanes = self._finished_lanes, set()
            for lane in sorted(lanes):
                try:
                    top_up(self.store, self.publisher, self.batch_service.windows, lane=lane)
                except Exception:
                    log.exception("topping up lane %s failed; the maintenance sweep will", lane)

    def _register(self) -> None:
        paused = [lane for lane, p in self.gate.snapshot().items() if p]
        with self.store.session() as s:
            register_worker(
                s,
                hostname=self.hostname,
                lane=self.lane,
                pid=os.getpid(),
                concurrency=self.concurrency,
                paused_lanes=paused,
            )
        self._last_heartbeat = time.time()

    def _batch_open(self, batch_id: str) -> bool:
        with self.store.session() as s:
            row = queries.batch_open_state(s, batch_id)
        return row is not None and row[0] == "in_progress" and row[1] is None

    # -- the chunk task -------------------------------------------------------------------------

    def run_chunk(self, batch_id: str, chunk_no: int) -> str:
        """The Celery task body. Returns the outcome; raises ``Reject`` to requeue or dead-letter."""
        try:
            return self._run_chunk(batch_id, chunk_no)
        except Reject:
            raise
        except Exception as exc:
            # Acked exceptions would lose the chunk: requeue it; the delivery count bounds loops.
            log.exception("chunk %s/%s failed; requeueing", batch_id, chunk_no)
            time.sleep(1.0)
            raise Reject(repr(exc), requeue=True) from exc

    def _begin(self, batch_id: str, chunk_no: int) -> tuple[Any, BatchRecord] | None:
        with self.store.session() as s:
            queries.begin_chunk(
                s, batch_id=batch_id, chunk_no=chunk_no, worker=self.hostname, now=time.time()
            )
            chunk = queries.chunk_delivery(s, batch_id=batch_id, chunk_no=chunk_no)
            batch = s.exec(select(BatchRecord).where(BatchRecord.id == batch_id)).first()
        if chunk is None or batch is None:
            return None
        return chunk, batch

    def _pending_lines(self, batch_id: str, chunk_no: int) -> list[PendingLine]:
        with self.store.session() as s:
            rows = queries.pending_lines_of_chunk(s, batch_id=batch_id, chunk_no=chunk_no)
        return [PendingLine(r[0], r[1], r[2]) for r in rows]

    def _set_chunk(self, batch_id: str, chunk_no: int, state: str, *, released: bool = False) -> None:
        with self.store.session() as s:
            queries.set_chunk_state(s, batch_id=batch_id, chunk_no=chunk_no, state=state, released=released)

    def _finalize(self, batch_id: str) -> None:
        finalize_batch(
            self.store,
            self.files,
            batch_id,
            kind="complete",
            clock=self.clock,
            after_final=self.jobs.after_final,
        )

    def _run_chunk(self, batch_id: str, chunk_no: int) -> str:
        begun = self._begin(batch_id, chunk_no)
        if begun is None:
            # Another deployment's message (two sharing a namespace but not a database): keep it
            # visible in the dead-letter queue rather than dropping someone's work.
            log.error("chunk %s/%s is not in this store; dead-lettering the message", batch_id, chunk_no)
            raise Reject("unknown chunk", requeue=False)
        chunk, batch = begun
        deliveries, releases, queue_lane = int(chunk[0]), int(chunk[1]), str(chunk[2])
        if batch.status != "in_progress" or batch.final_claim is not None:
            self._set_chunk(batch_id, chunk_no, "done")
            return "closed"
        lines = self._pending_lines(batch_id, chunk_no)
        if not lines:
            self._set_chunk(batch_id, chunk_no, "done")
            self._chunk_finished(queue_lane)
            self._finalize(batch_id)
            return "done"
        unclean = deliveries - 1 - releases  # earlier deliveries that ended without a clean release
        lane = queue_lane if self.lane == "all" else self.lane
        if unclean >= self.settings.delivery_limit:
            return self._dead_letter(batch, chunk_no, lines, deliveries, lane)
        plan = self._plan(batch, lane)
        if not plan.replicas:
            # No replica to send to right now (a pool scaled to zero, replicas not registered
            # yet): keep the work queued rather than failing it; expiry bounds the wait.
            log.warning(
                "no replicas for lane %s (pool %s, group %s); chunk %s/%s goes back to the queue",
                lane,
                batch.pool,
                batch.replica_group,
                batch_id,
                chunk_no,
            )
            self._set_chunk(batch_id, chunk_no, "queued", released=True)
            time.sleep(NO_REPLICA_RETRY_S)
            raise Reject("no replicas", requeue=True)
        work = ChunkWork(batch_id, chunk_no, plan.lane, batch.priority, batch.endpoint, lines)
        future = asyncio.run_coroutine_threadsafe(self._execute(work, batch, plan), self._loop)
        outcome: ChunkOutcome = future.result()
        if outcome.kind == "done":
            self._set_chunk(batch_id, chunk_no, "done")
            self._chunk_finished(queue_lane)
            self._finalize(batch_id)
            return "done"
        if outcome.kind == "closed":
            self._set_chunk(batch_id, chunk_no, "done")
            return "closed"
        # Released: paused, preempted or out of time. Progress is in the store; requeue the rest.
        self._set_chunk(batch_id, chunk_no, "queued", released=True)
        log.info(
            "chunk %s/%s released (%s): %d recorded, %d left",
            batch_id,
            chunk_no,
            outcome.reason,
            outcome.recorded,
            outcome.remaining,
        )
        if outcome.reason == "paused":
            time.sleep(PAUSE_REQUEUE_DELAY_S)
        raise Reject(f"released: {outcome.reason}", requeue=True)

    def _dead_letter(
        self, batch: BatchRecord, chunk_no: int, lines: list[PendingLine], deliveries: int, lane: str
    ) -> str:
        message = (
            f"the chunk holding this request was delivered {deliveries} times without finishing "
            f"(delivery limit {self.settings.delivery_limit}); it was dead-lettered"
        )
        record_results(
            self.store,
            batch.id,
            [LineResult.failure(ln.line_no, "delivery_limit_exceeded", message) for ln in lines],
        )
        self._set_chunk(batch.id, chunk_no, "dead")
        # Never run, so no middleware saw it end: counted here, under the lane the other chunk
        # outcomes are (alert TidalDeadLetteredChunks).
        self.metrics.chunks.labels(lane, "dead_lettered").inc()
        self._chunk_finished(batch.queue_lane)
        log.error("chunk %s/%s dead-lettered after %d deliveries", batch.id, chunk_no, deliveries)
        self._finalize(batch.id)
        raise Reject("delivery limit exceeded", requeue=False)

    def _plan(self, batch: BatchRecord, lane: str) -> _Plan:
        pools = chunk_pools(
            self.fleet,
            lane=lane,
            worker_lane=self.lane,
            pool=batch.pool,
            model=batch.model,
            regions=batch.allowed_regions,
        )
        runtime = self._runtime_replicas()
        replicas = [(p, r) for p in pools for r in p.replicas]
        listed = {r.name for _, r in replicas}
        replicas += [(p, r) for p in pools for r in runtime.get(p.name, []) if r.name not in listed]
        if batch.replica_group is not None:
            replicas = [(p, r) for p, r in replicas if r.group == batch.replica_group]
        return _Plan(lane, replicas)

    def _runtime_replicas(self) -> dict[str, list[ReplicaSpec]]:
        """Replicas registered at run time, per pool (re-read when older than the TTL; the last
        good list while the store is unreachable)."""
        with self._runtime_lock:
            if time.monotonic() - self._runtime_read_at < RUNTIME_REPLICAS_TTL_S:
                return self._runtime
            try:
                with self.store.session() as s:
                    rows = runtime_replicas(s)
            except Exception:
                log.exception("could not read the replicas registered at run time; using the last list")
                return self._runtime
            found: dict[str, list[ReplicaSpec]] = {}
            for row in rows:
                try:
                    spec = ReplicaSpec(name=row.name, url=row.url, group=row.group, max_loras=row.max_loras)
                except ValueError:
                    log.warning("ignoring run-time replica %r: invalid record", row.name)
                    continue
                found.setdefault(row.pool, []).append(spec)
            self._runtime, self._runtime_read_at = found, time.monotonic()
            return found

    def _replica_set(self, plan: _Plan, group: str | None) -> ReplicaSet:
        """The replica set of ``plan``'s pools, its membership brought up to ``plan`` (on the
        event loop)."""
        key = (plan.lane, tuple(sorted({p.name for p, _ in plan.replicas})), group)
        rs = self._replica_sets.get(key)
        current = {(s.name, s.client.base_url): s for s in rs.slots} if rs is not None else {}
        slots = [
            current.get((r.name, r.base_url))
            or ReplicaSlot(
                r.name,
                ReplicaClient(r.base_url, name=r.name, pool_size=p.batch_concurrency_per_replica),
                p.batch_concurrency_per_replica,
            )
            for p, r in plan.replicas
        ]
        if rs is None:
            rs = self._replica_sets[key] = ReplicaSet(slots)
        elif [id(s) for s in slots] != [id(s) for s in rs.slots]:
            for gone in rs.replace_slots(slots):
                self._loop.create_task(_close_when_idle(gone))
        return rs

    async def _execute(self, work: ChunkWork, batch: BatchRecord, plan: _Plan) -> ChunkOutcome:
        rs = self._replica_set(plan, batch.replica_group)
        last_beat = time.monotonic()

        async def record(results: list[LineResult]) -> int:
            nonlocal last_beat
            n = await asyncio.to_thread(record_results, self.store, work.batch_id, results)
            if time.monotonic() - last_beat > HEARTBEAT_EVERY_S:
                last_beat = time.monotonic()
                await asyncio.to_thread(self._heartbeat, work.batch_id, work.chunk_no)
            return n

        return await self.executor.run(work, rs, record)

    def _heartbeat(self, batch_id: str, chunk_no: int) -> None:
        with self.store.session() as s:
            queries.heartbeat_chunk(s, batch_id=batch_id, chunk_no=chunk_no, now=time.time())
