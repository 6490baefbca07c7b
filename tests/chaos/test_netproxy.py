"""The fault proxy does what the latency, loss and cut rows rely on, measured on an echo server."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.chaos.netproxy import FaultProxy
from tidal.replicas.launcher import free_port


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    port = free_port()
    server = socketserver.ThreadingTCPServer(("127.0.0.1", port), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()


def _round_trip(sock: socket.socket, payload: bytes) -> float:
    t0 = time.monotonic()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "connection closed"
        got += chunk
    assert got == payload
    return time.monotonic() - t0


def test_delay_is_added_each_way_and_pipelined(echo_port: int) -> None:
    with FaultProxy(echo_port, seed=1) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as s:
        clean = _round_trip(s, b"ping")
        proxy.degrade(delay_s=0.1)
        delayed = _round_trip(s, b"ping")
        # Given 0.1 s each way, a round trip takes 0.2 s more,
        assert 0.19 <= delayed - clean < 0.5, (clean, delayed)
        # and ten messages sent at once arrive together, 0.2 s late, not 2 s (a link, not a queue).
        t0 = time.monotonic()
        for i in range(10):
            s.sendall(f"m{i};".encode())
            time.sleep(0.005)
        got = b""
        while got.count(b";") < 10:
            got += s.recv(65536)
        assert time.monotonic() - t0 < 0.5
        proxy.clean()
        assert _round_trip(s, b"ping") < 0.1


def test_loss_stalls_a_chunk_and_everything_behind_it(echo_port: int) -> None:
    with FaultProxy(echo_port, seed=3) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as s:
        proxy.degrade(delay_s=0.0, loss=1.0, rto_s=(0.2, 0.2))
        # Every chunk lost once each way: 0.4 s per round trip, in order.
        took = _round_trip(s, b"abc")
        assert 0.39 <= took < 0.8 and proxy.stats.stalled == 2, (took, proxy.stats)


def _reset(sock: socket.socket) -> bool:
    """The peer reset (or closed) the connection: a read ends at once with nothing."""
    sock.settimeout(2)
    try:
        return sock.recv(10) == b""
    except ConnectionResetError:
        return True


def test_a_cut_resets_open_and_new_connections_until_restored(echo_port: int) -> None:
    with FaultProxy(echo_port) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as s:
            _round_trip(s, b"x")
            proxy.cut()
            assert _reset(s)
        with socket.create_connection(("127.0.0.1", proxy.port)) as s2:
            assert _reset(s2)
        proxy.restore()
        with socket.create_connection(("127.0.0.1", proxy.port)) as s3:
            assert _round_trip(s3, b"back") < 0.2
        assert proxy.stats.reset >= 3  # the open one (both sides) and the new one


def test_a_partition_holds_everything_until_restored(echo_port: int) -> None:
    with FaultProxy(echo_port) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as s:
        _round_trip(s, b"x")
        proxy.partition()
        s.settimeout(0.3)
        s.sendall(b"hello?")
        with pytest.raises(TimeoutError):
            s.recv(10)  # nothing comes back on the open connection, nor is it reset
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=0.3) as s2:
            s2.sendall(b"new?")
            with pytest.raises(TimeoutError):
                s2.recv(10)  # nor on a new one
        proxy.restore()
        s.settimeout(2)
        assert s.recv(10) == b"hello?"  # what was held arrives once the link is back
        assert proxy.stats.held >= 1
