"""A simulated replica served in-process (uvicorn in a thread) for HTTP-level tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import uvicorn

from tidal.replicas.launcher import free_port
from tidal.replicas.sim.server import ServerConfig, SimServer


class RunningSim:
    def __init__(self, app: SimServer, port: int) -> None:
        self.app = app
        self.port = port
        self.url = f"http://127.0.0.1:{port}"


@contextmanager
def run_sim(**config: object) -> Iterator[RunningSim]:
    """Serve ``SimServer(ServerConfig(**config))`` on a free port until the block ends."""
    app = SimServer(ServerConfig(**config))  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", loop="asyncio")
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the simulated replica did not start")
        time.sleep(0.02)
    try:
        yield RunningSim(app, port)
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def sim_server() -> Callable[..., object]:
    return run_sim
