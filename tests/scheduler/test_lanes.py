"""SharedLane: one worker lane behind several shared pools' gates."""

from __future__ import annotations

import pytest

from tidal.scheduler.lanes import SharedLane
from tidal.workers.control import PauseAck

pytestmark = pytest.mark.anyio


class FakeSwitch:
    def __init__(self, confirm: bool = True) -> None:
        self.calls: list[tuple[str, str]] = []
        self.confirm = confirm

    def pause(self, lane: str = "shared", reason: str = "", *, timeout: float = 2.0) -> PauseAck:
        self.calls.append(("pause", reason))
        return PauseAck(lane, "pause", ["shared@a"], self.confirm, [] if self.confirm else ["shared@a"])

    def resume(self, lane: str = "shared", reason: str = "", *, timeout: float = 2.0) -> PauseAck:
        self.calls.append(("resume", reason))
        return PauseAck(lane, "resume", ["shared@a"], self.confirm)


async def test_the_lane_resumes_only_when_every_shared_pool_is_open() -> None:
    switch = FakeSwitch()
    lane = SharedLane(switch)
    assert (await lane.pause("east", "queue_wait")).confirmed
    assert (await lane.pause("west", "kv_usage")).confirmed
    ack = await lane.resume("east", "calm")
    # West still needs its replicas: nothing was sent, and the gate of east counts as applied.
    assert ack.confirmed and "west" in ack.detail
    assert [c[0] for c in switch.calls] == ["pause", "pause"]
    await lane.resume("west", "calm")
    assert switch.calls[-1] == ("resume", "west: calm")


async def test_an_unconfirmed_switch_is_reported_unconfirmed_with_the_stragglers() -> None:
    lane = SharedLane(FakeSwitch(confirm=False))
    ack = await lane.pause("interactive", "queue_wait")
    assert not ack.confirmed and "shared@a" in ack.detail and ack.workers == ("shared@a",)
