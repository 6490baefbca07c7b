"""Pausing and resuming a lane at the Celery level, confirmed.

``pause_lane`` sends ``cancel_consumer`` for the queues the lane's workers would stop consuming,
to exactly those workers and expecting exactly their replies (``limit``: without it every
broadcast waits its whole timeout), then confirms with ``active_queues`` that none still
consumes them. Workers announce their lane in their node name (``shared@host-pid``); pass
``workers`` (e.g. ``workers_of_lane(session, "shared")`` from the store) to skip discovery.

The persisted state (``set_lane_paused``) and the in-flight abort (``publish_lane_control``) are
the other two parts of a pause; the scheduler does all three::

    with store.session() as s:
        set_lane_paused(s, "shared", True, "TTFT p95 over budget")
        hosts = workers_of_lane(s, "shared")
    publish_lane_control(settings.broker_url, topo, "shared", "pause")
    ack = pause_lane(app, "shared", workers=hosts, topology=topo)
    assert ack.confirmed
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from priority.queues import Topology
from workers.runtime import governed_queues, lane_of_hostname

__all__ = ["PauseAck", "discover_workers", "pause_lane", "resume_lane"]


@dataclass
class PauseAck:
    """What a pause or resume achieved, and how long confirming it took."""

    lane: str
    action: str
    workers: list[str]
    confirmed: bool
    still_wrong: list[str] = field(default_factory=list)  # workers not yet in the wanted state
    elapsed_s: float = 0.0


def discover_workers(app: Celery, lane: str, *, timeout: float = 1.0) -> list[str]:
    """Workers consuming ``lane`` found by ping (waits the whole timeout: prefer the registry)."""
    replies = app.control.ping(timeout=timeout) or []
    names = [name for reply in replies for name in reply]
    return sorted(n for n in names if governed_queues(lane_of_hostname(n), lane))


def _plan(workers: Sequence[str], lane: str, topology: Topology) -> dict[str, list[str]]:
    by_queue: dict[str, list[str]] = {}
    for w in workers:
        for q in governed_queues(lane_of_hostname(w), lane):
            by_queue.setdefault(topology.queue(q), []).append(w)
    return by_queue


def _consuming(app: Celery, workers: list[str], timeout: float) -> dict[str, set[str]]:
    reply = (
        app.control.inspect(destination=workers, timeout=timeout, limit=len(workers)).active_queues() or {}
    )
    return {w: {q.get("name", "") for q in (qs or [])} for w, qs in reply.items()}


def _switch(
    app: Celery,
    lane: str,
    *,
    pause: bool,
    workers: Sequence[str] | None,
    topology: Topology,
    timeout: float,
) -> PauseAck:
    t0 = time.monotonic()
    hosts = sorted(workers) if workers is not None else discover_workers(app, lane, timeout=timeout)
    plan = _plan(hosts, lane, topology)
    for queue, dest in plan.items():
        if pause:
            app.control.cancel_consumer(queue, destination=dest, reply=True, limit=len(dest), timeout=timeout)
        else:
            app.control.add_consumer(queue, destination=dest, reply=True, limit=len(dest), timeout=timeout)
    # The reply only says the command was scheduled: confirm from the workers' own queue lists.
    wrong: list[str] = []
    involved = sorted({w for dest in plan.values() for w in dest})
    deadline = time.monotonic() + timeout
    while involved:
        consuming = _consuming(app, involved, timeout=max(0.05, deadline - time.monotonic()))
        wrong = [
            w
            for w in involved
            if w not in consuming or any((q in consuming[w]) == pause for q, d in plan.items() if w in d)
        ]
        if not wrong or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return PauseAck(
        lane=lane,
        action="pause" if pause else "resume",
        workers=hosts,
        confirmed=not wrong,
        still_wrong=wrong,
        elapsed_s=time.monotonic() - t0,
    )


def pause_lane(
    app: Celery,
    lane: str,
    *,
    workers: Sequence[str] | None = None,
    topology: Topology | None = None,
    timeout: float = 1.0,
) -> PauseAck:
    """Stop the lane's workers consuming its queue(s); returns once they confirmed (or timeout)."""
    return _switch(
        app, lane, pause=True, workers=workers, topology=topology or _topology(app), timeout=timeout
    )


def resume_lane(
    app: Celery,
    lane: str,
    *,
    workers: Sequence[str] | None = None,
    topology: Topology | None = None,
    timeout: float = 1.0,
) -> PauseAck:
    """Let the lane's workers consume again (``add_consumer`` is idempotent)."""
    return _switch(
        app, lane, pause=False, workers=workers, topology=topology or _topology(app), timeout=timeout
    )


def _topology(app: Celery) -> Topology:
    exchange: Any = app.conf.control_exchange
    return Topology(str(exchange).removesuffix("-celery"))
