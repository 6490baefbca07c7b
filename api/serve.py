"""Serve the gateway from several processes on one port: ``tidal gateway --workers N``.

Each worker is a process of its own (started with ``spawn``: a fork would copy per-process
random state such as the request-id prefix) that builds its own application (its own registry, router,
admission queue and scraper, and its own place in the shared load state, :mod:`router.shared`)
and serves it with uvicorn on its own listening socket bound with ``SO_REUSEPORT``: the kernel
spreads new connections evenly over the workers' sockets (one accept queue shared by every worker
lets whichever wakes first take most of them), and a worker that dies takes its socket with it,
so connections go to the others until the supervisor has started it again. Each worker also
serves on a Unix socket of its own, in a directory only this user can enter, where the worker
answering ``GET /metrics`` fetches the others' series (:mod:`api.worker_metrics`).

The supervisor (this process) forwards SIGTERM and SIGINT to the workers as SIGTERM (uvicorn's
graceful stop: in-flight streams end, then the lifespan shutdown withdraws the worker's counts),
restarts a worker that exits on its own, and gives up when one keeps failing at start.

``build`` must be picklable (a module-level function, or a ``functools.partial`` of one).

Example::

    serve_workers(
        functools.partial(build_app, "fleet.yaml"),
        host="0.0.0.0", port=8000, workers=4, bounds=RequestBounds(),
    )
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from starlette.types import ASGIApp

from tidal.api.protocol import RequestBounds, bounded_protocol
from tidal.api.state import GatewayState
from tidal.api.worker_metrics import WorkerPeers
from tidal.logs import uvicorn_log_config

__all__ = ["reuseport_socket", "serve_workers"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_FAST_FAILURE_S = 5.0  # a worker that exits sooner after its start failed to start
_MAX_FAST_FAILURES = 3


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (not listening yet)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _unix_socket(path: Path) -> socket.socket:
    """A Unix stream socket bound to ``path`` (one a restarted worker left is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


def _worker(
    build: Callable[[], ASGIApp], host: str, port: int, bounds: RequestBounds, peers: WorkerPeers
) -> None:
    import uvicorn

    # Die with the supervisor even when it is killed outright (Linux).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    sock = reuseport_socket(host, port)
    own = _unix_socket(peers.socket_path(peers.index))
    app = build()
    state = getattr(getattr(app, "state", None), "tidal", None)
    if isinstance(state, GatewayState):
        state.workers = peers
    gc.freeze()  # as the one-process gateway does: long-lived objects out of the collector's walk
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=bounded_protocol(bounds),
        log_level="warning",
        log_config=uvicorn_log_config(),
        access_log=False,
        lifespan="on",
    )
    uvicorn.Server(config).run(sockets=[sock, own])


def serve_workers(
    build: Callable[[], ASGIApp],
    *,
    host: str,
    port: int,
    workers: int,
    bounds: RequestBounds,
) -> int:
    """Run ``workers`` processes serving ``build()`` on ``host:port`` until SIGTERM/SIGINT;
    returns the exit status (0 after a requested stop, 1 when a worker kept failing). Each
    bounds a request's head and body as :mod:`api.protocol` says."""
    # Fail here, clearly, when the port is taken by something that does not share it.
    reuseport_socket(host, port).close()
    ctx = multiprocessing.get_context("spawn")
    socket_dir = Path(tempfile.mkdtemp(prefix="tidal-gateway-"))  # (mode 0700)
    procs: list[BaseProcess] = []
    started: list[float] = []
    fast_failures = [0] * workers
    stopping = False

    def start(i: int) -> BaseProcess:
        p = ctx.Process(
            target=_worker,
            args=(build, host, port, bounds, WorkerPeers(i, workers, socket_dir)),
            name=f"tidal-gateway-{i}",
            daemon=False,
        )
        p.start()
        return p

    def stop(sig: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        for i in range(workers):
            procs.append(start(i))
            started.append(time.monotonic())
        while not stopping:
            wait([p.sentinel for p in procs], timeout=1.0)
            for i, p in enumerate(procs):
                if stopping or p.is_alive():
                    continue
                lived = time.monotonic() - started[i]
                fast_failures[i] = fast_failures[i] + 1 if lived < _FAST_FAILURE_S else 0
                print(
                    f"gateway worker {i} (pid {p.pid}) exited with code {p.exitcode} after {lived:.1f} s",
                    file=sys.stderr,
                )
                if fast_failures[i] >= _MAX_FAST_FAILURES:
                    print(f"gateway worker {i} keeps failing at start: stopping", file=sys.stderr)
                    status = 1
                    stop(signal.SIGTERM, None)
                    break
                time.sleep(min(1.0, 0.2 * fast_failures[i]))
                procs[i] = start(i)
                started[i] = time.monotonic()
        deadline = time.monotonic() + 30.0
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(socket_dir, ignore_errors=True)
    return status
