"""The producer side of the batch tier: publishing chunks as Celery tasks on the lane queues.

Only the message is published here (by task name); the consuming Celery app lives in
``workers/``, so the gateway never imports worker code. A chunk row is marked ``queued`` *after*
the broker confirmed the message: a crash in between leaves it ``pending`` and the maintenance
sweep publishes it again (a duplicate message costs only repeated work, never a lost line).

Chunks are published progressively (:func:`top_up`), so that tenants share a lane: each tenant
holds at most its :class:`Window` of chunks in a lane's queue (published and not yet finished);
the rest stay ``pending`` in the store. Whenever chunks finish (the worker that finished one, a
submission, a cancellation, and every maintenance sweep as a safety net) the windows are topped
up: most urgent priority first, then the tenants in turn (the one served longest ago first),
then each tenant's batches in order. RabbitMQ serves a priority level first in, first out, so a
small batch submitted after a huge one of another tenant waits behind at most that tenant's
window, not behind its whole batch. A tenant's claim happens under its row lock in the store
(:func:`lock_tenant`), so two gateways topping up together never pass a window.

Example::

    publisher = CeleryChunkPublisher.from_settings(settings)
    publisher.publish("batch_abc", 0, lane="shared", priority=9)
    top_up(store, publisher, tenant_windows(fleet, settings))   # -> chunks published
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from celery import Celery
from sqlmodel import Session

from tidal.batch_jobs import queries
from tidal.batch_jobs.queries import lock_tenant
from tidal.batch_jobs.store import Store
from tidal.fleet import FleetConfig
from tidal.priority.classes import Lane, rabbitmq_priority
from tidal.priority.queues import CHUNK_TASK, Topology, celery_base_config, is_amqp
from tidal.settings import Settings

__all__ = [
    "CeleryChunkPublisher",
    "ChunkPublisher",
    "PublishError",
    "Window",
    "WindowOf",
    "lock_tenant",
    "producer_app",
    "publish_pending",
    "release_stale_publishing",
    "requeue_stale_running",
    "tenant_windows",
    "top_up",
]

log = logging.getLogger(__name__)


class PublishError(Exception):
    """The broker did not take the message (unreachable, or the lane queue is full)."""


class ChunkPublisher(Protocol):
    def publish(self, batch_id: str, chunk_no: int, *, lane: str, priority: int) -> None: ...


def producer_app(settings: Settings, *, name: str = "tidal-producer") -> Celery:
    """A Celery app with the shared configuration and no tasks: for publishing and control."""
    app = Celery(name, set_as_current=False)
    broker_dir = str(settings.resolved_broker_dir.resolve())
    app.conf.update(
        celery_base_config(settings.broker_url, Topology(settings.queue_namespace), broker_dir=broker_dir)
    )
    return app


class CeleryChunkPublisher:
    """Publishes chunk tasks with message priority and publisher confirms."""

    def __init__(self, app: Celery, topology: Topology) -> None:
        self.app = app
        self.topology = topology
        self._lock = threading.Lock()
        # Publisher confirms on this connection only: a chunk counts as queued once RabbitMQ has
        # it, while Celery's own traffic (task events, remote control) is not slowed by them.
        options = dict(app.conf.broker_transport_options or {})
        if is_amqp(str(app.conf.broker_url or "")):
            options["confirm_publish"] = True
        self._connection = app.connection_for_write(transport_options=options)

    @classmethod
    def from_settings(cls, settings: Settings) -> CeleryChunkPublisher:
        return cls(producer_app(settings), Topology(settings.queue_namespace))

    def publish(self, batch_id: str, chunk_no: int, *, lane: str, priority: int) -> None:
        queue = self.topology.kombu_queue(Lane(lane))
        try:
            with self._lock:  # one connection, many gateway threads
                self.app.send_task(
                    CHUNK_TASK,
                    args=[batch_id, chunk_no],
                    queue=queue,
                    routing_key=queue.routing_key,
                    exchange=queue.exchange,
                    priority=rabbitmq_priority(priority),
                    connection=self._connection,
                    retry=True,
                    retry_policy={
                        "max_retries": 2,
                        "interval_start": 0.2,
                        "interval_step": 0.5,
                        "interval_max": 1,
                    },
                )
        except Exception as exc:  # kombu/amqp raise many types; all mean "not taken"
            raise PublishError(f"could not publish chunk {batch_id}/{chunk_no}: {exc!r}") from exc

    def close(self) -> None:
        with self._lock:
            self._connection.release()
        self.app.close()


def publish_pending(
    store: Store,
    publisher: ChunkPublisher,
    *,
    batch_id: str | None = None,
    limit: int = 2000,
) -> int:
    """Publish chunks still ``pending`` (most urgent batches first), whatever the tenants'
    windows; returns how many went out. The tier itself publishes with :func:`top_up`; this is
    for tools that time the broker (``tidal bench batch`` publishes a burst of chunks with it).

    Stops at the first broker failure: the rest stay pending for the next sweep.
    """
    with store.session() as s:
        rows = queries.pending_chunks(s, batch_id=batch_id, limit=limit)
    sent = 0
    for page_start in range(0, len(rows), _PAGE):
        page = rows[page_start : page_start + _PAGE]
        n, failed = _publish_page(store, publisher, list(page))
        sent += n
        if failed:
            break
    return sent


_PAGE = 200


def _by_batch(items: list[tuple[str, int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for bid, chunk_no in items:
        out.setdefault(bid, []).append(chunk_no)
    return out


def _publish_page(store: Store, publisher: ChunkPublisher, page: list[Any]) -> tuple[int, bool]:
    """Claim a page of chunks in one statement per batch (two sweepers never publish the same
    chunk), publish them, then settle them; a claim whose publisher died goes back to pending
    after a minute (:func:`release_stale_publishing`)."""
    token = secrets.token_hex(8)
    with store.session() as s:
        for bid, nos in _by_batch([(r[0], r[1]) for r in page]).items():
            queries.claim_chunks(s, token=token, now=time.time(), batch_id=bid, chunk_nos=nos)
        claimed = queries.claimed_chunks(s, token)
    mine = {(r[0], r[1]) for r in claimed}
    done: list[tuple[str, int]] = []
    failed = False
    for bid, chunk_no, lane, priority in page:
        if (bid, chunk_no) not in mine:
            continue
        try:
            publisher.publish(bid, chunk_no, lane=lane, priority=priority)
        except PublishError as exc:
            log.warning("%s; will retry", exc)
            failed = True
            break
        done.append((bid, chunk_no))
    undone = [k for k in mine if k not in set(done)]
    with store.session() as s:
        for state, items in (("queued", done), ("pending", undone)):
            for bid, nos in _by_batch(items).items():
                queries.settle_chunks(s, token=token, batch_id=bid, chunk_nos=nos, state=state)
    return len(done), failed


# -- progressive publishing: tenants' windows -----------------------------------------------------


@dataclass(frozen=True)
class Window:
    """How much of one tenant's work a lane may hold in the broker at once (published and not yet
    finished): chunks, lines (a chunk counts the input lines it spans), or both; ``None`` bounds
    nothing of that kind. A tenant with nothing in flight may always send one chunk, even one
    spanning more lines than ``lines``, or that chunk would never run."""

    chunks: int | None = None
    lines: int | None = None

    def fits(self, in_flight: int, in_flight_lines: int, span: int) -> bool:
        """Whether one more chunk of ``span`` lines fits beside what is in flight."""
        if in_flight == 0:
            return True
        if self.chunks is not None and in_flight >= self.chunks:
            return False
        return self.lines is None or in_flight_lines + span <= self.lines


WindowOf = Callable[[str], Window]


def tenant_windows(fleet: FleetConfig, settings: Settings) -> WindowOf:
    """Each tenant's window per lane: its ``batch.max_lines_in_flight`` from the fleet config,
    else ``settings.batch_tenant_window_chunks`` chunks (for tenants the config does not list
    too, such as the development key's), so that fairness holds without any configuration."""
    default = Window(chunks=settings.batch_tenant_window_chunks)

    def window(tenant: str) -> Window:
        spec = fleet.tenant(tenant)
        if spec is not None and spec.batch.max_lines_in_flight is not None:
            return Window(lines=spec.batch.max_lines_in_flight)
        return default

    return window


class _Waiting(NamedTuple):
    tenant: str
    lane: str
    top_priority: int
    served_at: float


class _Claimed(NamedTuple):
    tenant: str
    batch_id: str
    chunk_no: int
    lane: str
    priority: int
    token: str


def _waiting(session: Session, lane: str | None, tenant: str | None) -> list[_Waiting]:
    """Tenants and lanes with pending chunks of open batches, each with its most urgent priority
    and when the tenant was last served."""
    rows = queries.waiting_tenants(session, lane=lane, tenant=tenant)
    return [_Waiting(str(r[0]), str(r[1]), int(r[2]), float(r[3])) for r in rows]


def _in_flight(
    session: Session, lane: str | None, tenant: str | None
) -> dict[tuple[str, str], tuple[int, int]]:
    """(chunks, lines) in flight per (tenant, lane)."""
    rows = queries.chunks_in_flight(session, lane=lane, tenant=tenant)
    return {(str(r[0]), str(r[1])): (int(r[2]), int(r[3])) for r in rows}


def _claim_window(
    store: Store, tenant: str, lane: str, window: Window, *, now: float, cap: int
) -> list[_Claimed]:
    """Under the tenant's lock: claim (``publishing``) the pending chunks that fit in its window
    on ``lane``, most urgent first, then in batch order; committed before anything is published,
    so the next dispatcher counts them."""
    token = secrets.token_hex(8)
    with store.session() as s:
        lock_tenant(s, tenant)
        n, lines = _in_flight(s, lane, tenant).get((tenant, lane), (0, 0))
        if not window.fits(n, lines, 1):
            return []
        room = cap
        if window.chunks is not None:
            room = min(room, max(1, window.chunks - n))
        if window.lines is not None:
            room = min(room, max(1, window.lines - lines))  # a chunk spans at least one line
        rows = queries.pending_chunks_of_tenant(s, tenant=tenant, lane=lane, limit=room)
        take: list[tuple[str, int]] = []
        for bid, chunk_no, _priority, span in rows:
            if not window.fits(n + len(take), lines, int(span)):
                break  # strictly in order: a smaller chunk behind does not jump the queue
            take.append((str(bid), int(chunk_no)))
            lines += int(span)
        if not take:
            return []
        for bid, nos in _by_batch(take).items():
            queries.claim_chunks(s, token=token, now=now, batch_id=bid, chunk_nos=nos)
        # A duplicate message may have started one meanwhile (pending -> running): not ours.
        claimed = queries.claimed_chunks_in_order(s, token=token, batch_ids=sorted({b for b, _ in take}))
        queries.mark_tenant_served(s, tenant, now=now)
    order = {key: i for i, key in enumerate(take)}
    out = [_Claimed(tenant, str(r[0]), int(r[1]), str(r[2]), int(r[3]), token) for r in claimed]
    return sorted(out, key=lambda c: order[(c.batch_id, c.chunk_no)])


def top_up(
    store: Store,
    publisher: ChunkPublisher,
    windows: WindowOf,
    *,
    lane: str | None = None,
    tenant: str | None = None,
    limit: int = 2000,
) -> int:
    """Publish pending chunks into the room of each tenant's window (only ``lane``'s, only
    ``tenant``'s when given); returns how many went out.

    The order of publication is the order of service within a priority level (RabbitMQ serves
    each level first in, first out): most urgent first, then one chunk per tenant in turn (the
    tenant served longest ago first), then each tenant's batches in order. Stops at the first
    broker failure: what was claimed and not published goes back to ``pending``.
    """
    now = time.time()
    with store.session() as s:
        waiting = _waiting(s, lane, tenant)
        busy = _in_flight(s, lane, tenant) if waiting else {}
    # Claim the most urgent work first, so that a pass cut short by ``limit`` still serves it.
    waiting.sort(key=lambda w: (-w.top_priority, w.served_at, w.tenant, w.lane))
    claimed: list[_Claimed] = []
    for w in waiting:
        window = windows(w.tenant)
        n, lines = busy.get((w.tenant, w.lane), (0, 0))
        if len(claimed) >= limit or not window.fits(n, lines, 1):
            continue  # full, as far as a read without the lock tells: no lock taken
        claimed += _claim_window(store, w.tenant, w.lane, window, now=now, cap=limit - len(claimed))
    if not claimed:
        return 0
    served = {w.tenant: w.served_at for w in waiting}
    turn: dict[tuple[str, str, int], int] = {}
    keyed: list[tuple[tuple[int, int, float, str], _Claimed]] = []
    for c in claimed:  # each tenant's claims are in its own order already
        k = turn[(c.tenant, c.lane, c.priority)] = turn.get((c.tenant, c.lane, c.priority), -1) + 1
        keyed.append(((-c.priority, k, served[c.tenant], c.tenant), c))
    keyed.sort(key=lambda kc: kc[0])
    done: list[_Claimed] = []
    for _, c in keyed:
        try:
            publisher.publish(c.batch_id, c.chunk_no, lane=c.lane, priority=c.priority)
        except PublishError as exc:
            log.warning("%s; will retry", exc)
            break
        done.append(c)
    sent = {(c.batch_id, c.chunk_no) for c in done}
    undone = [c for c in claimed if (c.batch_id, c.chunk_no) not in sent]
    with store.session() as s:
        for state, items in (("queued", done), ("pending", undone)):
            by_token: dict[str, list[tuple[str, int]]] = {}
            for c in items:
                by_token.setdefault(c.token, []).append((c.batch_id, c.chunk_no))
            for token, keys in by_token.items():
                for bid, nos in _by_batch(keys).items():
                    queries.settle_chunks(s, token=token, batch_id=bid, chunk_nos=nos, state=state)
    return len(done)


def release_stale_publishing(store: Store, *, now: float, older_than_s: float = 60.0) -> int:
    """Chunks claimed by a publisher that died before it finished go back to pending."""
    with store.session() as s:
        return queries.release_stale_publishing(s, cut=now - older_than_s)


def requeue_stale_running(store: Store, *, now: float, stale_after_s: float) -> int:
    """Mark chunks whose worker stopped heartbeating as pending again.

    Only for brokers that do not redeliver unacknowledged messages of a dead consumer (the
    embedded fallback); RabbitMQ redelivers them itself.
    """
    with store.session() as s:
        return queries.requeue_stale_running(s, now=now, cut=now - stale_after_s)
