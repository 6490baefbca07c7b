"""The batch gate's :class:`~scheduler.gate.LaneController` over the batch tier's shared lane.

Every shared pool is served by the one ``shared`` worker lane, so the lane is paused while **any**
shared pool's gate is paused and consumes again only when every one is open. Each call runs the
whole acknowledged switch of :class:`workers.control.LaneSwitch` (persisted lane state, the
control fanout that makes running chunks abort and requeue, ``cancel_consumer`` confirmed with
``active_queues``) in a thread, so the gate's loop keeps sampling meanwhile.

Example::

    lane = SharedLane(LaneSwitch(settings))
    await GateController(gates, source=gateway_admin, lane=lane, clock=SystemClock()).run()
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from tidal.scheduler.gate import LaneAck
from tidal.workers.control import PauseAck

__all__ = ["SharedLane", "Switch"]


class Switch(Protocol):
    """What :class:`SharedLane` drives (``workers.control.LaneSwitch``)."""

    def pause(self, lane: str = "shared", reason: str = "", *, timeout: float = 2.0) -> PauseAck: ...

    def resume(self, lane: str = "shared", reason: str = "", *, timeout: float = 2.0) -> PauseAck: ...


class SharedLane:
    """Pauses the ``shared`` lane while any shared pool's gate is paused (see the module docstring)."""

    lane = "shared"

    def __init__(self, switch: Switch, *, timeout_s: float = 2.0) -> None:
        self.switch = switch
        self.timeout_s = timeout_s
        self.paused_pools: set[str] = set()
        self._lock = asyncio.Lock()

    async def pause(self, pool: str, reason: str) -> LaneAck:
        async with self._lock:
            self.paused_pools.add(pool)
            ack = await asyncio.to_thread(
                self.switch.pause, self.lane, f"{pool}: {reason}", timeout=self.timeout_s
            )
            return _ack(ack)

    async def resume(self, pool: str, reason: str) -> LaneAck:
        async with self._lock:
            self.paused_pools.discard(pool)
            if self.paused_pools:
                # Another shared pool still needs its replicas: the lane stays paused for it.
                return LaneAck(True, f"lane stays paused for {', '.join(sorted(self.paused_pools))}")
            ack = await asyncio.to_thread(
                self.switch.resume, self.lane, f"{pool}: {reason}", timeout=self.timeout_s
            )
            return _ack(ack)


def _ack(ack: PauseAck) -> LaneAck:
    detail = f"{ack.action} of {len(ack.workers)} worker(s) in {ack.elapsed_s:.3f} s"
    if ack.still_wrong:
        detail += f"; not yet: {', '.join(ack.still_wrong)}"
    return LaneAck(ack.confirmed, detail, tuple(ack.workers))
