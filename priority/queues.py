"""The RabbitMQ topology of the batch tier, and the direct RabbitMQ work Celery does not do.

One classic queue per lane, every name prefixed by a namespace (``TIDAL_QUEUE_NAMESPACE``,
default ``tidal``) so that deployments and test runs can share a broker::

    <ns>.batch      direct exchange        chunks, routed by lane
    <ns>.reserved   queue, x-max-priority  the dedicated batch pool
    <ns>.spot       queue, x-max-priority  preemptible capacity
    <ns>.shared     queue, x-max-priority  batches with lane "any"; borrowed interactive replicas
    <ns>.dlx        fanout exchange        where rejected chunks go
    <ns>.dead       queue                  dead-lettered chunks (bounded)
    <ns>.control    fanout exchange        pause/resume heard by running chunks

Priority direction (written once, see :mod:`priority.classes`): a message's RabbitMQ priority is
the batch priority 0..9 and **larger is delivered first**; inside a replica the vLLM ``priority``
goes the other way (**smaller is scheduled sooner**).

RabbitMQ 3.10's classic queues have no ``x-delivery-limit`` (quorum queues have it, but no
priorities there), so the delivery limit is enforced by the workers: each chunk counts its
deliveries in the store; past ``TIDAL_DELIVERY_LIMIT`` it is rejected without requeue, dead-letters
here, and its lines go to the batch's error file with the reason.

Every queue is bounded (``x-max-length`` with ``reject-publish``): a full lane refuses new chunks
at publish time (publisher confirms) and the chunk is retried later; nothing is dropped.

Example::

    topo = Topology("tidal")
    declare_topology(settings.broker_url, topo)
    queue_depths()                          # {"reserved": 0, "spot": 0, "shared": 12}
    publish_lane_control("shared", "pause")  # broker and namespace from TIDAL_* settings
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

import pika
from kombu.entity import Exchange, Queue

from tidal.priority.classes import BATCH_PRIORITY_MAX, Lane

__all__ = [
    "CHUNK_TASK",
    "LANES",
    "LANE_PREFERENCES",
    "LaneControl",
    "Topology",
    "celery_base_config",
    "declare_topology",
    "delete_topology",
    "is_amqp",
    "lane_for_preference",
    "parse_lane_control",
    "pika_parameters",
    "publish_lane_control",
    "queue_depths",
]

# pika logs every connection step at INFO; our short-lived connections would flood the logs.
logging.getLogger("pika").setLevel(logging.WARNING)

CHUNK_TASK = "tidal.run_chunk"
LANES: tuple[Lane, ...] = (Lane.RESERVED, Lane.SPOT, Lane.SHARED)
LANE_PREFERENCES = ("reserved", "spot", "any")
MAX_QUEUE_LENGTH = 1_000_000  # chunks per lane queue
MAX_DEAD_LETTERS = 100_000


def lane_for_preference(preference: str) -> Lane:
    """The queue a batch's chunks go to: ``reserved``/``spot`` their own, ``any`` the shared one.

    Workers of the ``shared`` lane consume only the shared queue (on borrowed interactive
    replicas); ``reserved`` and ``spot`` workers consume their own queue and the shared one too
    (on their own replicas), so pausing the shared lane never stalls ``any`` work entirely.
    """
    if preference == "reserved":
        return Lane.RESERVED
    if preference == "spot":
        return Lane.SPOT
    if preference == "any":
        return Lane.SHARED
    raise ValueError(f"unknown lane {preference!r} (known: {', '.join(LANE_PREFERENCES)})")


@dataclass(frozen=True)
class Topology:
    """Names and arguments of the batch tier's exchanges and queues under one namespace."""

    namespace: str = "tidal"

    def queue(self, lane: str) -> str:
        return f"{self.namespace}.{Lane(lane).value}"

    @property
    def exchange(self) -> str:
        return f"{self.namespace}.batch"

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.namespace}.dlx"

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.namespace}.dead"

    @property
    def control_exchange(self) -> str:
        return f"{self.namespace}.control"

    @property
    def celery_control_exchange(self) -> str:
        # Celery's remote control (pidbox) and events get their own names too, so Flower and
        # cancel_consumer see only this deployment's workers.
        return f"{self.namespace}-celery"

    @property
    def celery_event_exchange(self) -> str:
        return f"{self.namespace}-celeryev"

    def queue_arguments(self) -> dict[str, Any]:
        """Identical for Celery's (kombu) and our own (pika) declarations, or RabbitMQ refuses."""
        return {
            "x-max-priority": BATCH_PRIORITY_MAX + 1,
            "x-dead-letter-exchange": self.dead_letter_exchange,
            "x-max-length": MAX_QUEUE_LENGTH,
            "x-overflow": "reject-publish",
        }

    def kombu_queue(self, lane: str) -> Queue:
        name = self.queue(lane)
        exchange = Exchange(self.exchange, type="direct", durable=True)  # type: ignore[no-untyped-call]
        return Queue(  # type: ignore[no-untyped-call]
            name,
            exchange,
            routing_key=name,
            durable=True,
            queue_arguments=self.queue_arguments(),
        )

    def kombu_queues(self) -> list[Queue]:
        return [self.kombu_queue(lane) for lane in LANES]


def is_amqp(url: str) -> bool:
    return url.split("://", 1)[0] in ("amqp", "pyamqp", "amqps")


def celery_base_config(
    broker_url: str, topology: Topology, *, broker_dir: str | None = None
) -> dict[str, Any]:
    """Celery settings every party shares: producer (gateway), workers, Flower and the scheduler."""
    conf: dict[str, Any] = {
        "broker_url": broker_url,
        "task_queues": topology.kombu_queues(),
        "task_default_queue": topology.queue(Lane.SHARED),
        "task_default_exchange": topology.exchange,
        "task_default_routing_key": topology.queue(Lane.SHARED),
        "task_create_missing_queues": False,
        "task_ignore_result": True,
        "result_backend": None,
        "control_exchange": topology.celery_control_exchange,
        "event_exchange": topology.celery_event_exchange,
        "task_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        # A dead connection (broker restart, half-open TCP) is noticed within ~2 heartbeats.
        "broker_heartbeat": 10,
        "enable_utc": True,
    }
    if broker_url.startswith("filesystem://"):
        if broker_dir is None:
            raise ValueError("the filesystem broker needs a directory")
        for d in (broker_dir, broker_dir + "-control"):
            os.makedirs(d, exist_ok=True)  # kombu expects them to exist
        conf["broker_transport_options"] = {
            "data_folder_in": broker_dir,
            "data_folder_out": broker_dir,
            "control_folder": broker_dir + "-control",
            "store_processed": False,
        }
    return conf


# -- pika ---------------------------------------------------------------------------------------


def pika_parameters(url: str, *, timeout: float = 5.0) -> pika.ConnectionParameters:
    """Connection parameters from a Celery-style broker URL (``amqp://u:p@h:5672//`` = vhost ``/``)."""
    parts = urllib.parse.urlsplit(url)
    if not is_amqp(url):
        raise ValueError(f"not an AMQP URL: {parts.scheme}://...")
    vhost = urllib.parse.unquote(parts.path[1:]) if parts.path else ""
    return pika.ConnectionParameters(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 5672,
        virtual_host=vhost or "/",
        credentials=pika.PlainCredentials(
            urllib.parse.unquote(parts.username or "guest"), urllib.parse.unquote(parts.password or "guest")
        ),
        heartbeat=10,
        blocked_connection_timeout=timeout,
        socket_timeout=timeout,
        stack_timeout=timeout,
        connection_attempts=1,
    )


def declare_topology(url: str, topology: Topology) -> None:
    """Declare the exchanges and queues (idempotent); the dead-letter side is ours alone."""
    conn = pika.BlockingConnection(pika_parameters(url))
    try:
        ch = conn.channel()
        ch.exchange_declare(topology.exchange, exchange_type="direct", durable=True)
        ch.exchange_declare(topology.dead_letter_exchange, exchange_type="fanout", durable=True)
        ch.exchange_declare(topology.control_exchange, exchange_type="fanout", durable=True)
        ch.queue_declare(
            topology.dead_letter_queue,
            durable=True,
            arguments={"x-max-length": MAX_DEAD_LETTERS, "x-overflow": "drop-head"},
        )
        ch.queue_bind(topology.dead_letter_queue, topology.dead_letter_exchange)
        for lane in LANES:
            name = topology.queue(lane)
            ch.queue_declare(name, durable=True, arguments=topology.queue_arguments())
            ch.queue_bind(name, topology.exchange, routing_key=name)
    finally:
        conn.close()


def delete_topology(url: str, topology: Topology) -> None:
    """Remove every queue and exchange of the namespace (tests clean up with it)."""
    conn = pika.BlockingConnection(pika_parameters(url))
    try:
        ch = conn.channel()
        for q in [topology.queue(lane) for lane in LANES] + [topology.dead_letter_queue]:
            ch.queue_delete(q)
        for x in (
            topology.exchange,
            topology.dead_letter_exchange,
            topology.control_exchange,
            f"{topology.celery_control_exchange}.pidbox",
            f"reply.{topology.celery_control_exchange}.pidbox",
            topology.celery_event_exchange,
        ):
            ch.exchange_delete(x)
    finally:
        conn.close()


def _where(url: str | None, topology: Topology | None) -> tuple[str, Topology]:
    if url is not None and topology is not None:
        return url, topology
    from tidal.settings import get_settings

    settings = get_settings()
    return url or settings.broker_url, topology or Topology(settings.queue_namespace)


def queue_depths(*, url: str | None = None, topology: Topology | None = None) -> dict[str, int]:
    """Messages ready in each lane's queue (passive declare; for the scheduler and autoscaler).

    ``url`` and ``topology`` default to ``TIDAL_BROKER_URL`` and ``TIDAL_QUEUE_NAMESPACE``.
    """
    url, topology = _where(url, topology)
    conn = pika.BlockingConnection(pika_parameters(url))
    try:
        ch = conn.channel()
        depths: dict[str, int] = {}
        for lane in LANES:
            ok = ch.queue_declare(topology.queue(lane), passive=True)
            depths[lane.value] = int(ok.method.message_count)
        return depths
    finally:
        conn.close()


# -- pause/resume fanout ------------------------------------------------------------------------

Action = Literal["pause", "resume"]


@dataclass(frozen=True)
class LaneControl:
    """One message on ``<ns>.control``: running chunks of ``lane`` pause or resume."""

    lane: str
    action: Action
    id: str

    def encode(self) -> bytes:
        return json.dumps({"lane": self.lane, "action": self.action, "id": self.id}).encode()


def parse_lane_control(body: bytes) -> LaneControl | None:
    """The message, or None when it is not a well-formed control message (ignored, not fatal)."""
    try:
        data = json.loads(body)
        lane, action, ident = data["lane"], data["action"], str(data.get("id", ""))
        Lane(lane)
    except (ValueError, KeyError, TypeError):
        return None
    if action not in ("pause", "resume"):
        return None
    return LaneControl(lane=lane, action=action, id=ident[:64])


def publish_lane_control(
    lane: str, action: Action, *, url: str | None = None, topology: Topology | None = None
) -> LaneControl:
    """Tell every running chunk of ``lane`` to pause (abort in-flight lines, requeue the rest) or
    resume. The scheduler calls this right after flipping the persisted lane state.

    ``url`` and ``topology`` default to ``TIDAL_BROKER_URL`` and ``TIDAL_QUEUE_NAMESPACE``.
    """
    url, topology = _where(url, topology)
    msg = LaneControl(lane=Lane(lane).value, action=action, id=secrets.token_hex(8))
    conn = pika.BlockingConnection(pika_parameters(url))
    try:
        ch = conn.channel()
        ch.exchange_declare(topology.control_exchange, exchange_type="fanout", durable=True)
        ch.basic_publish(
            topology.control_exchange,
            routing_key="",
            body=msg.encode(),
            properties=pika.BasicProperties(content_type="application/json", delivery_mode=1),
        )
    finally:
        conn.close()
    return msg
