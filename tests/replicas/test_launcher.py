"""``free_port``: ports a server can bind a moment later, which the kernel does not hand to the
local ends of outgoing connections in the meantime."""

from __future__ import annotations

import socket

from tidal.replicas.launcher import _ephemeral_low, free_port


def test_free_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)  # none handed out twice while its server may still be starting
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_taken_in_the_meantime_is_not_handed_out() -> None:
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {free_port() for _ in range(200)}
    finally:
        for s in held:
            s.close()


def test_outgoing_connections_do_not_take_it() -> None:
    port = free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        clients = [socket.create_connection(server.getsockname()) for _ in range(64)]
        try:
            assert port not in {c.getsockname()[1] for c in clients}
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # still free for its server
        finally:
            for c in clients:
                c.close()
