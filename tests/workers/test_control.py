"""LaneSwitch recovers from a broker connection dropped between two rare pause commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tidal.batch_jobs.store import Store, lane_states
from tidal.settings import Settings
from tidal.workers import app as workers_app, control as workers_control
from tidal.workers.control import LaneSwitch, PauseAck


class FakeApp:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_dropped_broker_connection_is_replaced_once_and_the_pause_confirmed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, broker_url="amqp://guest:guest@127.0.0.1:5672//", data_dir=tmp_path
    )
    store = Store.from_url(f"sqlite:///{tmp_path / 'tidal.db'}")
    stale, fresh = FakeApp(), FakeApp()
    used: list[Any] = []

    def switch(app: Any, lane: str, **kw: Any) -> PauseAck:
        used.append(app)
        if app is stale:
            raise ConnectionResetError(104, "Connection reset by peer")
        return PauseAck(lane, "pause", ["shared@a"], True)

    monkeypatch.setattr(workers_control, "_switch", switch)
    monkeypatch.setattr(workers_control, "publish_lane_control", lambda *a, **kw: None)
    monkeypatch.setattr(workers_app, "control_app", lambda s: fresh)
    lane = LaneSwitch(settings, store=store, app=stale)  # type: ignore[arg-type]

    ack = lane.pause("shared", "queue wait")

    # The stale app was closed, the command sent again on a fresh one, and the pause confirmed
    assert ack.confirmed and used == [stale, fresh] and stale.closed and lane.app is fresh
    with store.session() as s:
        assert lane_states(s)["shared"] is True
