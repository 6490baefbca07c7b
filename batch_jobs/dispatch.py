"""The producer side of the batch tier: publishing chunks as Celery tasks on the lane queues.

Only the message is published here (by task name); the consuming Celery app lives in
``workers/``, so the gateway never imports worker code. A chunk row is marked ``queued`` *after*
the broker confirmed the message: a crash in between leaves it ``pending`` and the maintenance
sweep publishes it again (a duplicate message costs only repeated work, never a lost line).

Example::

    publisher = CeleryChunkPublisher.from_settings(settings)
    publisher.publish("batch_abc", 0, lane="shared", priority=9)
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, Protocol

from celery import Celery
from sqlalchemy import bindparam, text

from batch_jobs.store import Store
from priority.classes import Lane, rabbitmq_priority
from priority.queues import CHUNK_TASK, Topology, celery_base_config, is_amqp
from tidal.settings import Settings

__all__ = [
    "CeleryChunkPublisher",
    "ChunkPublisher",
    "PublishError",
    "producer_app",
    "publish_pending",
    "release_stale_publishing",
    "requeue_stale_running",
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
    created_before: float | None = None,
    limit: int = 2000,
) -> int:
    """Publish chunks still ``pending`` (most urgent batches first); returns how many went out.

    Stops at the first broker failure: the rest stay pending for the next sweep.
    """
    where = ["c.state = 'pending'", "b.status = 'in_progress'"]
    params: dict[str, Any] = {"lim": limit}
    if batch_id is not None:
        where.append("c.batch_id = :b")
        params["b"] = batch_id
    if created_before is not None:
        where.append("c.created_at <= :cut")
        params["cut"] = created_before
    with store.session() as s:
        rows = (
            s.connection()
            .execute(
                text(
                    f"""SELECT c.batch_id, c.chunk_no, c.queue_lane, c.priority
                          FROM tidal_batch_chunks c JOIN tidal_batches b ON b.id = c.batch_id
                         WHERE {" AND ".join(where)}
                         ORDER BY c.priority DESC, b.seq, c.chunk_no LIMIT :lim"""
                ),
                params,
            )
            .all()
        )
    sent = 0
    for page_start in range(0, len(rows), _PAGE):
        page = rows[page_start : page_start + _PAGE]
        n, failed = _publish_page(store, publisher, list(page))
        sent += n
        if failed:
            break
    return sent


_PAGE = 200
_CLAIM = text(
    """UPDATE tidal_batch_chunks SET state = 'publishing', publish_claim = :t, published_at = :now
        WHERE batch_id = :b AND chunk_no IN :nos AND state = 'pending'"""
).bindparams(bindparam("nos", expanding=True))
_SETTLE = text(
    """UPDATE tidal_batch_chunks SET state = :new
        WHERE publish_claim = :t AND state = 'publishing' AND batch_id = :b AND chunk_no IN :nos"""
).bindparams(bindparam("nos", expanding=True))


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
            s.connection().execute(_CLAIM, {"t": token, "now": time.time(), "b": bid, "nos": nos})
        claimed = (
            s.connection()
            .execute(
                text(
                    """SELECT batch_id, chunk_no, queue_lane, priority FROM tidal_batch_chunks
                        WHERE publish_claim = :t AND state = 'publishing'"""
                ),
                {"t": token},
            )
            .all()
        )
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
                s.connection().execute(_SETTLE, {"new": state, "t": token, "b": bid, "nos": nos})
    return len(done), failed


def release_stale_publishing(store: Store, *, now: float, older_than_s: float = 60.0) -> int:
    """Chunks claimed by a publisher that died before it finished go back to pending."""
    with store.session() as s:
        return int(
            s.connection()
            .execute(
                text(
                    """UPDATE tidal_batch_chunks SET state = 'pending'
                        WHERE state = 'publishing' AND published_at < :cut"""
                ),
                {"cut": now - older_than_s},
            )
            .rowcount
            or 0
        )


def requeue_stale_running(store: Store, *, now: float, stale_after_s: float) -> int:
    """Mark chunks whose worker stopped heartbeating as pending again.

    Only for brokers that do not redeliver unacknowledged messages of a dead consumer (the
    embedded fallback); RabbitMQ redelivers them itself.
    """
    with store.session() as s:
        return int(
            s.connection()
            .execute(
                text(
                    """UPDATE tidal_batch_chunks SET state = 'pending', created_at = :now
                        WHERE state = 'running' AND heartbeat_at < :cut"""
                ),
                {"now": now, "cut": now - stale_after_s},
            )
            .rowcount
            or 0
        )
