"""The exact KV index: per replica, the blocks its prefix cache holds, from its KV events.

Replicas push (vLLM's ``--kv-events-config``; ``tidal sim --kv-events-endpoint``): every block
they cache or evict arrives as a ``BlockStored`` / ``BlockRemoved`` event
(:mod:`replicas.wire.kv_events`). A :class:`ReplicaBlockIndex` per replica applies them; the
``kv-index`` producer (:mod:`router.plugins.producers.kv_index`) reads it through the replica's
:class:`~router.types.ReplicaView` and falls back to its estimate for a replica whose stream is
absent or older than its bound. :class:`KVEventsTracker` is the gateway's built-in machinery: one
subscriber task per replica that announced an events endpoint (fleet config or admin API).

**Block keys.** The index names a block by its *content*: ``key = hash((parent key, extra
keys, *token ids))``, chained from :data:`ROOT_KEY`, computed in the gateway's process both from
the events' token ids and from a prompt's (:func:`chain_keys`, :class:`PromptKeys`). The engine's
own hash only links a block to its parent and to its removal. So what must match between a
replica and the gateways is what decides the token ids and their grouping -- the model's
tokenizer and chat template (the fleet's ``models[].tokenizer``), the block size (learned from
the events) and the extra keys (the LoRA adapter's name, a ``cache_salt``) -- and *not* the
engine's hash algorithm or ``PYTHONHASHSEED``: the gateway never recomputes the engine's hash.

**What the index claims.** ``complete`` -- it has followed the stream since the engine's cache
was empty (sequence 0, an ``AllBlocksCleared``, or a replay buffer reaching back to 0): its
blocks are the engine's. Otherwise (it joined late, or a gap could not be replayed) it holds a
subset of them, and the producer takes the larger of it and the estimate. ``as_of`` -- the
subscriber's clock when the index was last proven current (a batch in sequence, or an empty
answer to a replay question while the stream is silent); the producer uses it only while
``now - as_of <= max_staleness_s``.

Only the GPU tier (``medium`` GPU or unset) of the first KV cache group is indexed; events of
other media (CPU offload tiers) or groups, and blocks whose parent is unknown, are kept only as
far as needed to apply their removals.

Example::

    index = ReplicaBlockIndex()
    sub = KVEventSubscriber("tcp://10.0.0.5:5557", index, replay_endpoint="tcp://10.0.0.5:5558")
    keys = PromptKeys(lambda: tokenizer.encode(prompt))
    index.leading(keys(index.block_size))      # blocks of the prompt the replica holds
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import and_
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tidal.clock import Clock
from tidal.replicas.sim.tokenizer import (
    HFTokenizer,
    SegmentEncoder,
    SimTokenizer,
    WordTokenizer,
    flatten_messages,
)
from tidal.replicas.wire.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventSubscriber,
    SubscriberStats,
    external_hash,
)

__all__ = [
    "ROOT_KEY",
    "BlockHolders",
    "KVEventsEndpoints",
    "KVEventsTracker",
    "PromptKeys",
    "PromptTokenizer",
    "ReplicaBlockIndex",
    "block_key",
    "chain_keys",
    "chat_prompt_keys",
    "completion_prompt_keys",
    "load_prompt_tokenizer",
]

log = logging.getLogger(__name__)

# The parent of every chain's first block (any fixed int: keys never leave this process).
ROOT_KEY = 0x7164_616C_6B76_0001

_MISSING = object()
_SCAN_BLOCKS = 32  # prompts of up to this many blocks are matched by walking each index


def block_key(parent: int, extra: tuple[Any, ...] | None, token_ids: Sequence[int]) -> int:
    """The key of one full block after ``parent``. Keys never leave the process that computes
    them (Python salts str hashing per process), and the same process keys both the events and
    the prompts."""
    return hash((parent, extra or (), *token_ids))


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra: tuple[Any, ...] | None = None,
    salt: str | None = None,
    limit: int | None = None,
) -> tuple[int, ...]:
    """Keys of the full blocks of ``token_ids``, at most ``limit``.

    ``extra`` goes into every block (vLLM: the LoRA adapter's name), ``salt`` into the first one
    only (a request's ``cache_salt``), in vLLM's order of untagged extra keys.
    """
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[int] = []
    parent = ROOT_KEY
    for i in range(n):
        ex = extra or ()
        if i == 0 and salt is not None:
            ex = (*ex, salt)
        parent = hash((parent, ex, *token_ids[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return tuple(out)


class PromptKeys:
    """A prompt's block keys, computed the first time a block size asks for them (tokenising is
    the cost; a request whose candidates publish no events never pays it).

    ``tokens`` returns the prompt's token ids as the engine will see them; only the blocks the
    engine can hit are keyed (it recomputes the last token, so at most ``(n - 1) // block_size``).
    """

    __slots__ = ("_extra", "_memo", "_salt", "_tokens", "_tokens_fn")

    def __init__(
        self,
        tokens: Callable[[], Sequence[int]],
        *,
        extra: tuple[Any, ...] | None = None,
        salt: str | None = None,
    ) -> None:
        self._tokens_fn = tokens
        self._tokens: Sequence[int] | None = None
        self._extra = extra
        self._salt = salt
        self._memo: dict[int, tuple[int, ...]] = {}

    @property
    def token_ids(self) -> Sequence[int]:
        if self._tokens is None:
            self._tokens = self._tokens_fn()
        return self._tokens

    def __call__(self, block_size: int) -> tuple[int, ...]:
        keys = self._memo.get(block_size)
        if keys is None:
            ids = self.token_ids
            limit = max(0, len(ids) - 1) // block_size
            keys = chain_keys(ids, block_size, extra=self._extra, salt=self._salt, limit=limit)
            self._memo[block_size] = keys
        return keys


class BlockHolders:
    """The replicas holding each block: block key -> a bitmask of replicas (bit ``bit(name)``).
    A tracker keeps one over its replicas' indexes (content keys); the ``kv-index`` keeps one of
    its own over the blocks it sent (its estimate's keys). It nominates from both the replicas
    that hold the longest run of a prompt at pool scale: a lookup costs what the prompt's blocks
    cost, not what the pool costs. Ints only, so the garbage collector never walks it."""

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.names: list[str | None] = []  # by bit; None: a bit freed by a removed replica
        self.bits: dict[str, int] = {}  # name -> its bit

    def bit(self, name: str) -> int:
        """``name``'s bit (a fresh or freed one on first use)."""
        b = self.bits.get(name)
        if b is None:
            free = [i for i, n in enumerate(self.names) if n is None]
            b = free[0] if free else len(self.names)
            if free:
                self.names[b] = name
            else:
                self.names.append(name)
            self.bits[name] = b
        return b

    def release(self, name: str) -> None:
        """Forget ``name`` (its index has already discarded its blocks)."""
        b = self.bits.pop(name, None)
        if b is not None:
            self.names[b] = None

    def add(self, key: int, bit: int) -> None:
        self.masks[key] = self.masks.get(key, 0) | (1 << bit)

    def runs(self, keys: Sequence[int]) -> Callable[[int], int]:
        """How many of ``keys`` (a prompt's chained block keys) lead the prompt at each replica,
        as a function of the replica's bit. One pass over the prompt's blocks serves the whole
        pool (at C speed: the masks of the blocks, AND-ed along the prompt, so a replica's bit
        stays set exactly as far as it holds every block before), then a binary search per
        replica; asking each replica's index walks the prompt once per replica."""
        held_so_far = list(accumulate(map(self.masks.get, keys, repeat(0)), and_))
        n = len(held_so_far)

        def run(bit: int) -> int:
            m = 1 << bit
            if not n or not held_so_far[0] & m:
                return 0
            if held_so_far[-1] & m:
                return n
            return bisect_left(held_so_far, True, 1, n - 1, key=lambda x: not x & m)

        return run

    def discard(self, key: int, bit: int) -> None:
        m = self.masks.get(key)
        if m is not None:
            m &= ~(1 << bit)
            if m:
                self.masks[key] = m
            else:
                del self.masks[key]


class ReplicaBlockIndex:
    """One replica's prefix-cache blocks, as its KV events describe them (a
    :class:`~replicas.wire.kv_events.KVEventSink`).

    Blocks are counted by copy: vLLM stores a block computed by two requests at once twice and
    removes each copy on its own. ``max_blocks`` bounds the memory a publisher can make us use
    (the oldest entries go first).
    """

    def __init__(self, *, max_blocks: int = 1 << 21) -> None:
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self.complete = False
        self.as_of = -math.inf
        self._key_of: dict[int, int | None] = {}  # engine hash -> content key (None: not indexable)
        self._dups: dict[int, int] = {}  # engine hash -> copies, only where more than one
        self._count: dict[int, int] = {}  # content key -> copies
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.skipped = 0  # events of another medium or group, or not indexable blocks
        self.holders: BlockHolders | None = None  # the pool-wide inverted index it keeps current
        self._bit = 0

    def share(self, holders: BlockHolders, bit: int) -> None:
        """Keep ``holders`` current with this index's blocks under ``bit``."""
        self.holders, self._bit = holders, bit
        for key in self._count:
            holders.add(key, bit)

    def unshare(self) -> None:
        """Take this index's blocks out of its holders."""
        if self.holders is not None:
            for key in self._count:
                self.holders.discard(key, self._bit)
            self.holders = None

    def __len__(self) -> int:
        """Distinct indexed blocks (by content key)."""
        return len(self._count)

    # -- the sink --------------------------------------------------------------------------------

    def reset(self, *, complete: bool) -> None:
        if self.holders is not None:
            for key in self._count:
                self.holders.discard(key, self._bit)
        self._key_of.clear()
        self._dups.clear()
        self._count.clear()
        self.complete = complete

    def synced(self, at: float) -> None:
        self.as_of = at

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                if ev.medium not in (None, MEDIUM_GPU) or ev.group_idx not in (None, 0):
                    self.skipped += 1
                    continue
                for h in ev.block_hashes:
                    self._remove(external_hash(h))
            elif isinstance(ev, AllBlocksCleared):
                self.cleared += 1
                self.reset(complete=True)

    def _stored(self, ev: BlockStored) -> None:
        if ev.medium not in (None, MEDIUM_GPU) or ev.group_idx not in (None, 0):
            self.skipped += 1
            return
        bs = ev.block_size
        if self.block_size is None and bs > 0:
            self.block_size = bs
        hashes = ev.block_hashes
        n = len(hashes)
        parent: int | None
        if ev.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            got = self._key_of.get(external_hash(ev.parent_block_hash), None)
            parent = got
        tokens = ev.token_ids
        if bs != self.block_size or len(tokens) != n * bs:
            parent = None  # a partial or differently sized block: not comparable with prompts
            self.skipped += 1
        extras = ev.extra_keys
        lora: tuple[Any, ...] = (ev.lora_name,) if ev.lora_name is not None else ()
        for i in range(n):
            key: int | None = None
            if parent is not None:
                if extras is not None and i < len(extras):
                    e = extras[i]
                    extra = tuple(e) if e else ()
                else:
                    extra = lora
                key = hash((parent, extra, *tokens[i * bs : (i + 1) * bs]))
            self._add(external_hash(hashes[i]), key)
            parent = key

    def _add(self, h: int, key: int | None) -> None:
        self.stored += 1
        key_of = self._key_of
        old = key_of.get(h, _MISSING)
        if old is _MISSING:
            key_of[h] = key
        else:
            self._dups[h] = self._dups.get(h, 1) + 1
            key = old  # type: ignore[assignment]  # one engine hash, one content
        if key is not None:
            c = self._count.get(key, 0)
            self._count[key] = c + 1
            if not c and self.holders is not None:
                self.holders.add(key, self._bit)
        if len(key_of) > self.max_blocks:
            self._drop(next(iter(key_of)))
            self.complete = False

    def _remove(self, h: int) -> None:
        key = self._key_of.get(h, _MISSING)
        if key is _MISSING:
            return  # stored before we could see it (a late join), or already dropped
        self.removed += 1
        d = self._dups.get(h)
        if d is not None:
            if d > 2:
                self._dups[h] = d - 1
            else:
                del self._dups[h]
        else:
            del self._key_of[h]
        if key is not None:
            self._uncount(key)  # type: ignore[arg-type]

    def _drop(self, h: int) -> None:
        key = self._key_of.pop(h)
        copies = self._dups.pop(h, 1)
        if key is not None:
            for _ in range(copies):
                self._uncount(key)

    def _uncount(self, key: int) -> None:
        c = self._count.get(key, 0) - 1
        if c > 0:
            self._count[key] = c
        elif self._count.pop(key, None) is not None and self.holders is not None:
            self.holders.discard(key, self._bit)

    # -- reading ---------------------------------------------------------------------------------

    def fresh(self, now: float, bound_s: float) -> bool:
        """Proven current within ``bound_s`` of ``now``."""
        return now - self.as_of <= bound_s

    def leading_shared(
        self, keys: Sequence[int], memo: dict[int, tuple[Sequence[int], Callable[[int], int]]]
    ) -> int:
        """:meth:`leading`, read from the holders this index keeps current when it has some: a
        request's candidates that share them are matched in one pass over the prompt
        (:meth:`BlockHolders.runs`; ``memo``, one per request, keeps it for the next candidate).
        A prompt of a few blocks is cheaper to walk here."""
        holders = self.holders
        if holders is None or len(keys) <= _SCAN_BLOCKS:
            return self.leading(keys)
        # (by identity: the request's keys per block size are one tuple; kept, so its id is too)
        kept = memo.get(id(holders))
        if kept is None or kept[0] is not keys:
            kept = memo[id(holders)] = (keys, holders.runs(keys))
        return kept[1](self._bit)

    def leading(self, keys: Iterable[int]) -> int:
        """How many of ``keys`` (a prompt's chained block keys) lead the prompt in this cache --
        what the engine's prefix lookup would hit."""
        count = self._count
        n = 0
        for k in keys:
            if k not in count:
                break
            n += 1
        return n


# -- the gateway's subscriptions -------------------------------------------------------------------


@dataclass(frozen=True)
class KVEventsEndpoints:
    """Where one replica publishes: the PUB address to connect to, its replay address, topic."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass
class _Subscription:
    endpoints: KVEventsEndpoints
    index: ReplicaBlockIndex
    subscriber: KVEventSubscriber
    task: asyncio.Task[None] | None = None


class KVEventsTracker:
    """One KV-event subscription per replica that announced an endpoint; each fills the replica's
    :class:`ReplicaBlockIndex` (``state.kv_events``, which its views carry to the router).

    ``probe_interval_s`` is how long a silent stream waits before the replay socket is asked
    whether anything was missed (keep it well under the ``kv-index`` producer's
    ``max_staleness_s``, 2 s by default). Exposes ``tidal_router_kv_events_*`` metrics as a
    Prometheus collector.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        probe_interval_s: float = 0.25,
        replay_timeout_s: float = 0.5,
        max_blocks: int = 1 << 21,
    ) -> None:
        self.clock = clock
        self.probe_interval_s = probe_interval_s
        self.replay_timeout_s = replay_timeout_s
        self.max_blocks = max_blocks
        self._subs: dict[str, _Subscription] = {}
        self._running = False
        self.holders = BlockHolders()  # every subscribed replica's blocks, by block

    def __contains__(self, name: str) -> bool:
        return name in self._subs

    def add(self, name: str, endpoints: KVEventsEndpoints) -> ReplicaBlockIndex:
        """Subscribe to replica ``name``'s events (started at once if the tracker runs)."""
        if name in self._subs:
            raise ValueError(f"replica {name!r} already has a KV-event subscription")
        index = ReplicaBlockIndex(max_blocks=self.max_blocks)
        index.share(self.holders, self.holders.bit(name))
        sub = KVEventSubscriber(
            endpoints.endpoint,
            index,
            replay_endpoint=endpoints.replay_endpoint,
            topic=endpoints.topic,
            clock=self.clock,
            probe_interval_s=self.probe_interval_s,
            replay_timeout_s=self.replay_timeout_s,
        )
        s = self._subs[name] = _Subscription(endpoints, index, sub)
        if self._running:
            s.task = asyncio.get_running_loop().create_task(self._run(name, sub))
        return index

    async def _run(self, name: str, sub: KVEventSubscriber) -> None:
        while True:
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # the gateway must outlive anything a publisher sends
                log.exception("KV-event subscription of %s failed; restarting it", name)
                await asyncio.sleep(1.0)

    def start(self) -> None:
        """Start every subscription on the running loop."""
        self._running = True
        loop = asyncio.get_running_loop()
        for name, s in self._subs.items():
            if s.task is None:
                s.task = loop.create_task(self._run(name, s.subscriber))

    async def remove(self, name: str) -> None:
        s = self._subs.pop(name, None)
        if s is not None and s.task is not None:
            s.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await s.task
        if s is not None:
            s.index.unshare()
            self.holders.release(name)

    async def stop(self) -> None:
        self._running = False
        for name in list(self._subs):
            s = self._subs[name]
            if s.task is not None:
                s.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await s.task
                s.task = None

    def index(self, name: str) -> ReplicaBlockIndex | None:
        s = self._subs.get(name)
        return s.index if s is not None else None

    def stats(self, name: str) -> SubscriberStats | None:
        s = self._subs.get(name)
        return s.subscriber.stats if s is not None else None

    def summary(self, name: str) -> dict[str, Any] | None:
        """The subscription's state for ``GET /admin/replicas``."""
        s = self._subs.get(name)
        if s is None:
            return None
        idx, st = s.index, s.subscriber.stats
        age = self.clock.now() - idx.as_of
        return {
            "endpoint": s.endpoints.endpoint,
            "replay_endpoint": s.endpoints.replay_endpoint,
            "topic": s.endpoints.topic,
            "blocks": len(idx),
            "block_size": idx.block_size,
            "complete": idx.complete,
            "age_s": round(age, 3) if math.isfinite(age) else None,
            "last_seq": st.last_seq,
            "gaps": st.gaps,
            "rebuilds": st.rebuilds,
            "malformed": st.malformed,
        }

    # -- metrics ---------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        now = self.clock.now()
        age = GaugeMetricFamily(
            "tidal_router_kv_events_age_seconds",
            "Seconds since the replica's KV index was last proven current (its bound decides use)",
            labels=["replica"],
        )
        blocks = GaugeMetricFamily(
            "tidal_router_kv_events_blocks", "Blocks in the replica's exact KV index", labels=["replica"]
        )
        complete = GaugeMetricFamily(
            "tidal_router_kv_events_complete",
            "1 when the index has followed the replica's stream since its cache was empty",
            labels=["replica"],
        )
        counters = {
            what: CounterMetricFamily(f"tidal_router_kv_events_{what}", doc, labels=["replica"])
            for what, doc in (
                ("batches", "Event batches applied (live or replayed)"),
                ("gaps", "Sequence gaps seen on the live stream"),
                ("rebuilds", "Index resets because replay could not cover a gap"),
                ("restarts", "Publisher restarts seen (the sequence went back, or it came back)"),
                ("malformed", "Messages or batches that could not be decoded"),
                ("probe_failures", "Replay questions on a silent stream left unanswered"),
            )
        }
        for name, s in self._subs.items():
            a = now - s.index.as_of
            age.add_metric([name], a if math.isfinite(a) else float("inf"))
            blocks.add_metric([name], len(s.index))
            complete.add_metric([name], 1.0 if s.index.complete else 0.0)
            st = s.subscriber.stats
            for what, fam in counters.items():
                fam.add_metric([name], float(getattr(st, what)))
        yield age
        yield blocks
        yield complete
        yield from counters.values()


# -- the gateway's tokenisation ----------------------------------------------------------------------


class PromptTokenizer:
    """A model's tokenizer as the gateway uses it: chat prompts through a
    :class:`~replicas.sim.tokenizer.SegmentEncoder` (pieces between special tokens cached, so a
    shared system prompt or a conversation's earlier turns are tokenised once), completions whole."""

    def __init__(self, tokenizer: SimTokenizer) -> None:
        self.tokenizer = tokenizer
        self.chat = SegmentEncoder(tokenizer)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.chat.encode(self.tokenizer.render_chat(messages))

    def prompt_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)


def load_prompt_tokenizer(spec: str) -> PromptTokenizer:
    """The tokenizer a fleet model names (``models[].tokenizer``): ``sim`` for the simulator's
    built-in one, else a model directory (``tokenizer.json`` and chat template; needs the
    ``tokenizers`` and ``jinja2`` packages). Raises ``ValueError`` when it cannot be loaded."""
    if spec == "sim":
        return PromptTokenizer(WordTokenizer())
    try:
        return PromptTokenizer(HFTokenizer(spec))
    except ImportError as exc:
        raise ValueError(
            f"tokenizer {spec!r} needs the {exc.name!r} package (pip install tokenizers jinja2)"
        ) from None
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"tokenizer {spec!r} cannot be loaded: {exc}") from None


def chat_prompt_keys(
    tokenizer: PromptTokenizer,
    messages: Sequence[Any],
    *,
    adapter: str | None = None,
    salt: str | None = None,
) -> PromptKeys | None:
    """A chat request's block keys, tokenised as the replicas do (the chat template, then the
    ids without added special tokens); ``None`` for content the template cannot render here."""
    if not all(isinstance(m, dict) for m in messages):
        return None
    try:
        flat = flatten_messages(messages)
    except ValueError:
        return None
    return PromptKeys(lambda: tokenizer.chat_ids(flat), extra=(adapter,) if adapter else None, salt=salt)


def completion_prompt_keys(
    tokenizer: PromptTokenizer, prompt: Any, *, adapter: str | None = None, salt: str | None = None
) -> PromptKeys | None:
    """A completion request's block keys (a string with the tokenizer's special tokens, or token
    ids as given); ``None`` for several prompts."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    extra = (adapter,) if adapter else None
    if isinstance(prompt, str):
        text = prompt
        return PromptKeys(lambda: tokenizer.prompt_ids(text), extra=extra, salt=salt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        return PromptKeys(lambda: ids, extra=extra, salt=salt)
    return None
