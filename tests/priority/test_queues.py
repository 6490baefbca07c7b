"""The batch tier's RabbitMQ topology on a real broker: priority queues, dead letters, depths and
the pause/resume fanout, each test under its own namespace."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pika
import pytest

from tests.batch_tier import RABBIT_URL, require_rabbitmq, wait_for
from tidal.priority.classes import Lane
from tidal.priority.queues import (
    Topology,
    declare_topology,
    delete_topology,
    lane_for_preference,
    parse_lane_control,
    pika_parameters,
    publish_lane_control,
    queue_depths,
)

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def topo() -> Iterator[Topology]:
    require_rabbitmq()
    t = Topology(f"t{secrets.token_hex(5)}")
    declare_topology(RABBIT_URL, t)
    yield t
    delete_topology(RABBIT_URL, t)


@pytest.fixture
def channel() -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    conn = pika.BlockingConnection(pika_parameters(RABBIT_URL))
    yield conn.channel()
    conn.close()


def test_lane_preferences_map_to_queues() -> None:
    assert [lane_for_preference(p) for p in ("reserved", "spot", "any")] == [
        Lane.RESERVED,
        Lane.SPOT,
        Lane.SHARED,
    ]
    with pytest.raises(ValueError, match="unknown lane"):
        lane_for_preference("fast")


def test_pika_parameters_read_celery_urls() -> None:
    p = pika_parameters("amqp://u%40x:p%2Fw@mq.internal:5673/batch%2Fprod")
    assert (p.host, p.port, p.virtual_host) == ("mq.internal", 5673, "batch/prod")
    assert (p.credentials.username, p.credentials.password) == ("u@x", "p/w")
    assert pika_parameters(RABBIT_URL).virtual_host == "/"


def test_declaring_is_idempotent_and_depths_count_ready_messages(topo: Topology, channel) -> None:  # type: ignore[no-untyped-def]
    declare_topology(RABBIT_URL, topo)  # again: same arguments, no PRECONDITION_FAILED
    # Given three chunks on the spot lane
    for _ in range(3):
        channel.basic_publish(topo.exchange, topo.queue("spot"), b"{}", pika.BasicProperties(priority=1))
    # Then the depths say so
    assert queue_depths(url=RABBIT_URL, topology=topo) == {"reserved": 0, "spot": 3, "shared": 0}


def test_larger_priority_is_delivered_first(topo: Topology, channel) -> None:  # type: ignore[no-untyped-def]
    # Given messages published low to high priority while nobody consumes
    for p in (0, 3, 9, 5):
        channel.basic_publish(
            topo.exchange, topo.queue("shared"), str(p).encode(), pika.BasicProperties(priority=p)
        )
    # When they are fetched, the most urgent (largest number) comes first
    got = [channel.basic_get(topo.queue("shared"), auto_ack=True)[2] for _ in range(4)]
    assert got == [b"9", b"5", b"3", b"0"]


def test_a_rejected_chunk_dead_letters(topo: Topology, channel) -> None:  # type: ignore[no-untyped-def]
    channel.basic_publish(topo.exchange, topo.queue("reserved"), b"chunk")
    method, _, _ = channel.basic_get(topo.queue("reserved"))
    # When a worker rejects it without requeue (past the delivery limit)
    channel.basic_reject(method.delivery_tag, requeue=False)
    # Then it sits in the dead-letter queue (RabbitMQ moves it asynchronously)
    got = wait_for(
        lambda: (r := channel.basic_get(topo.dead_letter_queue, auto_ack=True))[2] is not None and r,
        5,
        "the dead letter",
    )
    _, props, body = got
    assert body == b"chunk"
    assert props.headers["x-death"][0]["queue"] == topo.queue("reserved")


def test_pause_and_resume_reach_every_listener(topo: Topology, channel) -> None:  # type: ignore[no-untyped-def]
    # Given two running chunks' listeners bound to the control fanout
    queues = []
    for _ in range(2):
        q = channel.queue_declare("", exclusive=True).method.queue
        channel.queue_bind(q, topo.control_exchange)
        queues.append(q)
    # When the scheduler pauses the shared lane
    sent = publish_lane_control("shared", "pause", url=RABBIT_URL, topology=topo)
    publish_lane_control("shared", "resume", url=RABBIT_URL, topology=topo)
    # Then both hear pause then resume
    for q in queues:
        heard = [parse_lane_control(channel.basic_get(q, auto_ack=True)[2]) for _ in range(2)]
        assert [(m.lane, m.action) for m in heard if m] == [("shared", "pause"), ("shared", "resume")]
        assert heard[0] is not None and heard[0].id == sent.id


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"lane": "shared"}',
        b'{"lane": "moon", "action": "pause"}',
        b'{"lane": "shared", "action": "stop"}',
    ],
)
def test_malformed_control_messages_are_ignored(body: bytes) -> None:
    assert parse_lane_control(body) is None


def test_broker_and_namespace_default_to_the_settings(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tidal.settings import get_settings

    monkeypatch.setenv("TIDAL_BROKER_URL", RABBIT_URL)
    monkeypatch.setenv("TIDAL_QUEUE_NAMESPACE", topo.namespace)
    get_settings.cache_clear()
    try:
        assert queue_depths() == {"reserved": 0, "spot": 0, "shared": 0}
        assert publish_lane_control("shared", "pause").action == "pause"
    finally:
        get_settings.cache_clear()
