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
    publish_lane_control("shared", "pause", url=settings.broker_url, topology=topo)
    ack = pause_lane(app, "shared", workers=hosts, topology=topo)
    assert ack.confirmed
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError

from tidal.batch_jobs.store import Store, set_lane_paused, worker_paused_lanes, workers_of_lane
from tidal.priority.queues import Topology, is_amqp, publish_lane_control
from tidal.settings import Settings
from tidal.workers.runtime import governed_queues, lane_of_hostname

__all__ = ["LaneSwitch", "PauseAck", "discover_workers", "pause_lane", "resume_lane"]

log = logging.getLogger(__name__)


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


class LaneSwitch:
    """A whole pause (or resume) in one call, for the scheduler's batch gate:

    1. the persisted lane state (workers started later read it);
    2. the control fanout (running chunks abort in-flight lines and requeue the rest);
    3. ``cancel_consumer``/``add_consumer`` to the lane's live workers, confirmed.

    Idempotent; call it again until ``confirmed``. On a broker without remote control (the
    embedded fallback) steps 2-3 are replaced by the workers' own polling of the persisted state,
    confirmed from what each worker last reported in the store (within a few seconds).

    Example::

        switch = LaneSwitch(settings)
        ack = await asyncio.to_thread(switch.pause, "shared", "queue wait p95 0.8 s")
    """

    def __init__(self, settings: Settings, *, store: Store | None = None, app: Celery | None = None) -> None:
        from tidal.workers.app import control_app

        self.settings = settings
        self.topology = Topology(settings.queue_namespace)
        self.store = store or Store.from_url(settings.resolved_database_url)
        self.amqp = is_amqp(settings.broker_url)
        self.app = app or (control_app(settings) if self.amqp else None)

    def pause(self, lane: str = "shared", reason: str = "", *, timeout: float = 2.0) -> PauseAck:
        return self._switch(lane, True, reason, timeout)

    def resume(self, lane: str = "shared", reason: str = "", *, timeout: float = 2.0) -> PauseAck:
        return self._switch(lane, False, reason, timeout)

    def _switch(self, lane: str, pause: bool, reason: str, timeout: float) -> PauseAck:
        t0 = time.monotonic()
        with self.store.session() as s:
            set_lane_paused(s, lane, pause, reason)
            hosts = workers_of_lane(s, lane)
        if self.amqp and self.app is not None:
            publish_lane_control(
                lane, "pause" if pause else "resume", url=self.settings.broker_url, topology=self.topology
            )
            try:
                ack = _switch(
                    self.app, lane, pause=pause, workers=hosts, topology=self.topology, timeout=timeout
                )
            except (OSError, OperationalError) as exc:
                # The broker dropped a pooled connection (a restart, a half-open TCP): start again
                # on a fresh app once; a second failure is the caller's to retry.
                log.warning("lane %s: broker connection lost (%s); reconnecting", lane, exc)
                self._reconnect()
                ack = _switch(
                    self.app, lane, pause=pause, workers=hosts, topology=self.topology, timeout=timeout
                )
            ack.elapsed_s = time.monotonic() - t0
            return ack
        # No remote control: wait until every live worker of the lane reports the new state.
        deadline = t0 + timeout
        while True:
            with self.store.session() as s:
                views = worker_paused_lanes(s, hosts)
            wrong = sorted(h for h in hosts if (lane in views.get(h, set())) != pause)
            if not wrong or time.monotonic() >= deadline:
                return PauseAck(
                    lane, "pause" if pause else "resume", hosts, not wrong, wrong, time.monotonic() - t0
                )
            time.sleep(0.1)

    def _reconnect(self) -> None:
        from tidal.workers.app import control_app

        if self.app is not None:
            self.app.close()
        self.app = control_app(self.settings)

    def close(self) -> None:
        if self.app is not None:
            self.app.close()
        self.store.dispose()
