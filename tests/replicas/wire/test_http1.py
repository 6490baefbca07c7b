"""The proxy's lean HTTP/1.1 pool against a real aiohttp server on a socket: streaming, reuse,
limits, timeouts, aborts and broken connections."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from tidal.replicas.errors import ReplicaStreamError, ReplicaTimeout, ReplicaUnavailable
from tidal.replicas.launcher import free_port
from tidal.replicas.wire.http1 import ConnectionPool

pytestmark = pytest.mark.anyio

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Server:
    def __init__(self) -> None:
        self.peers: set[int] = set()
        self.inflight = 0
        self.most_inflight = 0
        self.disconnects = 0
        self.seen_headers: list[dict[str, str]] = []


@asynccontextmanager
async def _serve(
    handler: Handler, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[str, _Server]]:
    server = _Server()

    async def wrapped(request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer:
            server.peers.add(peer[1])
        server.seen_headers.append({k.lower(): v for k, v in request.headers.items()})
        server.inflight += 1
        server.most_inflight = max(server.most_inflight, server.inflight)
        try:
            return await handler(request)
        except (ConnectionResetError, asyncio.CancelledError):
            server.disconnects += 1
            raise
        finally:
            server.inflight -= 1

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", wrapped)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    try:
        yield f"{'https' if tls else 'http'}://{host}:{port}", server
    finally:
        await runner.cleanup()


async def _stream(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = int(request.query.get("n", "3"))
    for i in range(n):
        await resp.write(f"data: {i}\n\n".encode())
        await asyncio.sleep(float(request.query.get("gap", "0.01")))
    await resp.write_eof()
    return resp


async def _breaks(request: web.Request) -> web.StreamResponse:
    """One event, then the connection closes under the stream."""
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"data: 0\n\n")
    assert request.transport is not None
    request.transport.close()
    return resp


async def test_streams_reuse_connections_and_pass_headers() -> None:
    async with _serve(_stream) as (url, server):
        pool = ConnectionPool(url + "/base", headers={"Authorization": "Bearer k"})
        for _ in range(3):
            async with pool.request("POST", "/v1/x?n=4", b'{"a": 1}', {"X-Request-Id": "r1"}) as resp:
                assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
                pieces = [p async for p in resp.iter_chunks()]
            assert b"".join(pieces) == b"".join(f"data: {i}\n\n".encode() for i in range(4))
            assert len(pieces) >= 2  # delivered as it arrives, not at the end
        assert len(server.peers) == 1  # one keep-alive connection for all three
        h = server.seen_headers[-1]
        assert h["authorization"] == "Bearer k" and h["x-request-id"] == "r1" and h["content-length"] == "8"
        assert h["host"] == url.removeprefix("http://")
        await pool.close()


async def test_error_statuses_are_returned_with_their_body() -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "no"}}, status=429)

    async with _serve(refuse) as (url, _):
        pool = ConnectionPool(url)
        async with pool.request("POST", "/v1/x", b"{}") as resp:
            assert resp.status == 429 and await resp.read() == b'{"error": {"message": "no"}}'
        await pool.close()


async def test_refused_and_silent_replicas_fail_before_the_response() -> None:
    with pytest.raises(ReplicaUnavailable):
        async with ConnectionPool(f"http://127.0.0.1:{free_port()}").request("POST", "/", b""):
            pass

    async def silent(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(5)
        return web.Response()

    async with _serve(silent) as (url, _):
        with pytest.raises(ReplicaTimeout):
            async with ConnectionPool(url, read_timeout=0.2).request("POST", "/", b""):
                pass


async def test_a_stalled_or_broken_stream_raises_a_stream_error() -> None:
    async with _serve(_stream) as (url, _):
        pool = ConnectionPool(url, read_timeout=0.2)
        # The read timeout bounds each wait for data, not the stream: 1 s of 0.1 s gaps is fine.
        async with pool.request("POST", "/?n=10&gap=0.1", b"") as resp:
            assert (await resp.read()).count(b"data: ") == 10
        with pytest.raises(ReplicaStreamError):
            async with pool.request("POST", "/?n=3&gap=1", b"") as resp:
                async for _ in resp.iter_chunks():
                    pass

    async with _serve(_breaks) as (url, _):
        got: list[bytes] = []
        with pytest.raises(ReplicaStreamError):
            async with ConnectionPool(url).request("POST", "/", b"") as resp:
                async for piece in resp.iter_chunks():
                    got.append(piece)
        assert b"".join(got) == b"data: 0\n\n"


async def test_abort_closes_the_connection_so_the_replica_sees_the_client_go() -> None:
    async with _serve(_stream) as (url, server):
        pool = ConnectionPool(url)
        with pytest.raises(ReplicaStreamError):
            async with pool.request("POST", "/?n=100&gap=0.02", b"") as resp:
                async for _ in resp.iter_chunks():
                    resp.abort()
        for _ in range(100):
            if server.disconnects:
                break
            await asyncio.sleep(0.02)
        assert server.disconnects == 1
        # A response left unread also closes its connection: the next request opens a new one.
        async with pool.request("POST", "/?n=50&gap=0.02", b"") as resp:
            pass
        async with pool.request("POST", "/?n=1", b"") as resp:
            assert await resp.read() == b"data: 0\n\n"
        assert len(server.peers) == 3
        await pool.close()


async def test_at_most_limit_requests_at_once() -> None:
    async with _serve(_stream) as (url, server):
        pool = ConnectionPool(url, limit=2)

        async def one() -> bytes:
            async with pool.request("POST", "/?n=3&gap=0.05", b"") as resp:
                return await resp.read()

        bodies = await asyncio.gather(*(one() for _ in range(5)))
        assert all(b == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" for b in bodies)
        assert server.most_inflight == 2
        await pool.close()


async def test_an_unread_body_stops_reading_above_the_high_water_mark() -> None:
    async def flood(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(64):  # 4 MiB
            await resp.write(b"x" * 65536)
        await resp.write_eof()
        return resp

    async with _serve(flood) as (url, _):
        pool = ConnectionPool(url)
        async with pool.request("POST", "/", b"") as resp:
            await asyncio.sleep(0.5)  # the server writes as fast as it can; nobody reads
            buffered = resp._conn.buffered  # what the pool holds for the reader
            assert 0 < buffered <= 512 * 1024
            total = 0
            async for piece in resp.iter_chunks():
                total += len(piece)
        assert total == 64 * 65536
        await pool.close()


async def test_relay_hands_each_read_to_the_sink_from_the_connection_itself() -> None:
    async with _serve(_stream) as (url, server):
        pool = ConnectionPool(url)
        for _ in range(2):
            pieces: list[bytes] = []
            in_task: list[bool] = []

            def sink(piece: bytes, pieces: list[bytes] = pieces, in_task: list[bool] = in_task) -> None:
                pieces.append(piece)
                in_task.append(asyncio.current_task() is not None)

            async with pool.request("POST", "/?n=5&gap=0.02", b"") as resp:
                await resp.relay(sink)
            assert b"".join(pieces) == b"".join(f"data: {i}\n\n".encode() for i in range(5))
            assert len(pieces) >= 3  # as the pieces arrive, not at the end
            # From the read callback, not from a task woken for each piece (the first piece may
            # have come with the response, before the relay began).
            assert not any(in_task[1:])
        assert len(server.peers) == 1  # the connection is reused after a relayed body
        await pool.close()


async def test_relay_pauses_reading_while_the_sink_is_full() -> None:
    async def flood(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(64):  # 4 MiB, in pieces the pool takes one by one
            await resp.write(b"x" * 65536)
            await asyncio.sleep(0.002)
        await resp.write_eof()
        return resp

    async with _serve(flood) as (url, _):
        pool = ConnectionPool(url)
        drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        got: list[int] = []

        def sink(piece: bytes) -> asyncio.Future[None] | None:
            got.append(len(piece))
            return None if drained.done() else drained  # full until ``drained`` is set

        async with pool.request("POST", "/", b"") as resp:
            relay = asyncio.create_task(resp.relay(sink))
            await asyncio.sleep(0.5)  # the server writes as fast as it can; the sink is full
            assert resp._conn.paused and len(got) == 1 and not relay.done()  # one piece, then none
            drained.set_result(None)
            await relay
        assert sum(got) == 64 * 65536
        # A relay that begins after the unread body stopped the reading resumes it.
        async with pool.request("POST", "/", b"") as resp:
            await asyncio.sleep(0.5)
            assert resp._conn.paused
            got.clear()
            await asyncio.wait_for(resp.relay(lambda piece: got.append(len(piece))), 10)
        assert sum(got) == 64 * 65536
        await pool.close()


async def test_relay_fails_like_iter_chunks_on_a_stall_a_break_an_abort_or_a_sink_that_raises() -> None:
    async with _serve(_stream) as (url, server):
        pool = ConnectionPool(url, read_timeout=0.2)
        got: list[bytes] = []
        # The read timeout bounds each wait for a piece, not the stream.
        async with pool.request("POST", "/?n=10&gap=0.1", b"") as resp:
            await resp.relay(got.append)
        assert b"".join(got).count(b"data: ") == 10
        with pytest.raises(ReplicaStreamError, match="TimeoutError"):
            async with pool.request("POST", "/?n=3&gap=1", b"") as resp:
                await resp.relay(got.append)

        def boom(piece: bytes) -> None:
            raise ValueError("the sink broke")

        with pytest.raises(ReplicaStreamError, match="the sink broke"):
            async with pool.request("POST", "/?n=50&gap=0.02", b"") as resp:
                await resp.relay(boom)

        def abort(piece: bytes) -> None:
            resp.abort()

        with pytest.raises(ReplicaStreamError):
            async with pool.request("POST", "/?n=100&gap=0.02", b"") as resp:
                await resp.relay(abort)
        for _ in range(100):
            if server.disconnects >= 2:
                break
            await asyncio.sleep(0.02)
        assert server.disconnects == 2  # the sink that raised and the abort closed theirs
        await pool.close()

    async with _serve(_breaks) as (url, _):
        got = []
        with pytest.raises(ReplicaStreamError):
            async with ConnectionPool(url).request("POST", "/", b"") as resp:
                await resp.relay(got.append)
        assert b"".join(got) == b"data: 0\n\n"


async def test_a_response_is_handed_over_with_its_first_piece_not_with_its_headers() -> None:
    async def late(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)  # the headers go now
        await asyncio.sleep(0.3)
        await resp.write(b"data: 0\n\n")
        await resp.write_eof()
        return resp

    async with _serve(late) as (url, _):
        pool = ConnectionPool(url)
        started = asyncio.get_running_loop().time()
        async with pool.request("POST", "/", b"") as resp:
            waited = asyncio.get_running_loop().time() - started
            assert resp.status == 200 and resp._conn.chunks  # one wake-up, for both
            assert await resp.read() == b"data: 0\n\n"
        assert waited >= 0.25
        # An empty body ends at once.
        async with pool.request("HEAD", "/", b"") as resp:
            assert await resp.read() == b""
        await pool.close()


async def test_requests_cannot_be_split_by_injected_line_breaks() -> None:
    pool = ConnectionPool("http://127.0.0.1:9")
    with pytest.raises(ValueError):
        async with pool.request("POST", "/", b"", {"X-Request-Id": "a\r\nHost: evil"}):
            pass
    with pytest.raises(ValueError):
        async with pool.request("POST", "/x HTTP/1.1\r\nX: y", b""):
            pass
    with pytest.raises(ValueError):
        ConnectionPool("file:///etc/passwd")


def _certificates(tmp_path: Path) -> tuple[Path, ssl.SSLContext]:
    """A throwaway CA (its PEM file) and a server context with a leaf for ``localhost`` it signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = dt.datetime.now(dt.UTC)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("tidal test CA"))
        .issuer_name(name("tidal test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    leaf = (
        x509.CertificateBuilder()
        .subject_name(name("localhost"))
        .issuer_name(ca.subject)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "leaf.pem", tmp_path / "leaf.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_file, key_file)
    return ca_file, server


async def test_https_streams_over_a_verified_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_file, server_tls = _certificates(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))  # the system trust store, as the pool loads it
    async with _serve(_stream, tls=server_tls, host="localhost") as (url, server):
        pool = ConnectionPool(url, headers={"Authorization": "Bearer k"})
        for _ in range(2):
            async with pool.request("POST", "/v1/x?n=3", b"{}") as resp:
                assert resp.status == 200
                body = b"".join([p async for p in resp.iter_chunks()])
            assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert len(server.peers) == 1  # the TLS connection is kept alive and reused
        assert server.seen_headers[-1]["host"] == url.removeprefix("https://")
        await pool.close()


async def test_https_refuses_an_untrusted_or_misnamed_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_file, server_tls = _certificates(tmp_path)
    async with _serve(_stream, tls=server_tls, host="localhost") as (url, server):
        # A CA the system does not trust: the handshake fails before any request is sent.
        untrusted = ConnectionPool(url)
        with pytest.raises(ReplicaUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            async with untrusted.request("POST", "/v1/x", b"{}"):
                pass
        # A trusted CA, but the certificate names localhost, not the address asked for.
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
        misnamed = ConnectionPool(url.replace("localhost", "127.0.0.1"))
        with pytest.raises(ReplicaUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            async with misnamed.request("POST", "/v1/x", b"{}"):
                pass
        assert server.seen_headers == []
        await untrusted.close()
        await misnamed.close()
