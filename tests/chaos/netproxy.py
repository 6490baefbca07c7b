"""A userspace TCP fault proxy: what ``tc netem`` would do to one replica's traffic, without it.

The kernel of the machines this suite runs on has no ``netem`` qdisc (``tc qdisc add ... netem``
fails with "Specified qdisc kind is unknown"), and the suite does not run as root in network
namespaces. So a chaos test puts a :class:`FaultProxy` between the gateway and one replica (or a
replica's KV-event sockets) and registers the proxy's address in the replica's place.

What it emulates, per direction of each connection:

* **Latency** -- every chunk read from one side is written to the other ``delay_s`` later. Chunks
  are pipelined, as packets on a link are: a stream of tokens arrives ``delay_s`` late, not
  ``delay_s`` per token.
* **Packet loss** -- a fraction ``loss`` of the chunks (a seeded RNG picks them) is held for a
  retransmission timeout (uniform in ``rto_s``, Linux's minimum RTO is 200 ms) before it goes,
  and, as TCP delivers in order, every chunk behind it waits too (head-of-line blocking).
* **Cut** -- :meth:`cut` resets every connection and every new one until :meth:`restore`; the
  peers see what a dropped link or a firewall's reset looks like.
* **Partition** -- :meth:`partition` holds everything in flight on every connection, open or new,
  until :meth:`restore` (a link that went silent, no resets: TCP keeps retransmitting, so what was
  held arrives once the link is back; a connection whose client gave up meanwhile is reset, and
  what it sent never arrives).

A chunk is what one ``read`` returned (an SSE event, a ZMQ message, an HTTP request), not an IP
packet: the loss rate is per chunk. Settings change at run time (:meth:`degrade`,
:meth:`clean`); chunks already queued keep the time they were given.

The proxy runs its own event loop in a thread of its own, so the test's clients do not share a
loop with it.

Example::

    with FaultProxy(replica.port, seed=7) as proxy:
        fleet = fleet_dict([proxy.url, other.url])
        proxy.degrade(delay_s=0.15, loss=0.05)
        ...
        proxy.clean()
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass, field

from tidal.replicas.launcher import free_port

__all__ = ["FaultProxy", "ProxyStats"]

_READ = 65536


@dataclass
class ProxyStats:
    """What the proxy did since it started."""

    connections: int = 0
    chunks: int = 0  # forwarded, both directions
    stalled: int = 0  # held for a retransmission timeout (emulated loss)
    reset: int = 0  # connections reset by a cut (open ones and refused new ones)
    held: int = 0  # chunks held by a partition


@dataclass
class FaultProxy:
    """A TCP proxy on ``127.0.0.1:port`` in front of ``127.0.0.1:upstream_port`` (see the module
    docstring); a context manager that starts and stops its thread."""

    upstream_port: int
    port: int = field(default_factory=free_port)
    seed: int = 0
    delay_s: float = 0.0
    loss: float = 0.0
    rto_s: tuple[float, float] = (0.2, 0.4)
    stats: ProxyStats = field(default_factory=ProxyStats)
    _mode: str = "pass"  # pass | cut | partition
    _rng: random.Random = field(init=False)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def address(self, scheme: str = "tcp") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    # -- control (from any thread) ---------------------------------------------------------------

    def degrade(self, *, delay_s: float, loss: float = 0.0, rto_s: tuple[float, float] = (0.2, 0.4)) -> None:
        """Add ``delay_s`` to every chunk and stall a fraction ``loss`` of them for an RTO."""
        self.delay_s, self.loss, self.rto_s = delay_s, loss, rto_s

    def clean(self) -> None:
        """Forward at once again (chunks already queued keep their times)."""
        self.delay_s, self.loss = 0.0, 0.0

    def cut(self) -> None:
        """Reset every open connection, and every new one until :meth:`restore`."""
        self._mode = "cut"
        self._call(self._reset_all)

    def partition(self) -> None:
        """Hold everything in flight, on open and new connections, until :meth:`restore`."""
        self._mode = "partition"

    def restore(self) -> None:
        """Forward again (after :meth:`cut` or :meth:`partition`)."""
        self._mode = "pass"

    def _call(self, fn: object) -> None:
        if self._loop is not None:
            done = threading.Event()

            def run() -> None:
                try:
                    fn()  # type: ignore[operator]
                finally:
                    done.set()

            self._loop.call_soon_threadsafe(run)
            done.wait(5)

    def _reset_all(self) -> None:
        for w in list(self._writers):
            self.stats.reset += 1
            w.transport.abort()  # an RST, not a FIN: the link is gone, not closed politely
        self._writers.clear()

    # -- forwarding ------------------------------------------------------------------------------

    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self._mode == "cut":
            self.stats.reset += 1
            down_w.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            down_w.transport.abort()
            return
        self._writers.update((down_w, up_w))
        try:
            await asyncio.gather(self._pump(down_r, up_w), self._pump(up_r, down_w))
        except asyncio.CancelledError:
            pass  # the proxy stops: its connections go with it (no traceback per connection)
        finally:
            for w in (down_w, up_w):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read, stamp each chunk with the time it may go, write it then."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            last = 0.0
            try:
                while data := await reader.read(_READ):
                    at = loop.time() + self.delay_s
                    if self.loss and self._rng.random() < self.loss:
                        self.stats.stalled += 1
                        at += self._rng.uniform(*self.rto_s)
                    last = max(last, at)  # in order: nothing overtakes a stalled chunk
                    queue.put_nowait((last, data))
            except OSError:
                pass
            finally:
                if self._mode == "partition":
                    # Its sender gave up while the link was silent: what it sent is lost with it
                    # (its reset, not its data, is what the other side would see).
                    writer.transport.abort()
                queue.put_nowait(None)

        async def write() -> None:
            try:
                while (item := await queue.get()) is not None:
                    at, data = item
                    if (wait := at - loop.time()) > 0:
                        await asyncio.sleep(wait)
                    if self._mode == "partition":
                        self.stats.held += 1
                        while self._mode == "partition" and not writer.transport.is_closing():
                            await asyncio.sleep(0.02)
                    if writer.transport.is_closing():
                        return
                    writer.write(data)
                    await writer.drain()
                    self.stats.chunks += 1
                if writer.can_write_eof():
                    writer.write_eof()
            except OSError:
                writer.transport.abort()

        await asyncio.gather(read(), write())

    # -- lifetime --------------------------------------------------------------------------------

    def __enter__(self) -> FaultProxy:
        ready = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
            except OSError as exc:
                failed.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            server.close()
            self._reset_all()
            with contextlib.suppress(Exception):
                loop.run_until_complete(server.wait_closed())
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=serve, name=f"fault-proxy-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(10) or failed:
            raise RuntimeError(f"the fault proxy on port {self.port} did not start: {failed}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
