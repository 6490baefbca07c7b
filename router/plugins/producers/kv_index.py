"""``kv-index``: per replica, the prompt blocks it probably still holds in its KV cache.

The gateway cannot see a replica's prefix cache, but it knows every prompt it sent there. This
index keeps, per replica, the chained block hashes of those prompts (:mod:`router.prefix`; a
block hash names its whole prefix) in an LRU the size of the replica's KV cache (its scraped
``vllm:cache_config_info``: ``num_gpu_blocks x block_size`` tokens, else ``capacity_tokens``), so
a replica that takes many long prompts forgets old ones as its engine would. A prompt's blocks
are touched from last to first, like vLLM frees them: the shared head of a conversation stays
the most recent, its tail goes first, and what the index holds of any chain is a prefix of it.
That lets the match be a binary search: ``O(log blocks)`` per candidate. The LRUs are
:class:`~router.lru.ChainLRU`: a touch costs the blocks a prompt adds, not those it repeats, and
nothing in them is walked by the garbage collector, however full.

**At pool scale** it nominates the replicas holding the longest runs of the prompt, from an
inverted index: for the blocks at positions 0, 1, 3, 7, ... (``2^j - 1``) of every prompt sent,
a bitmask of the replicas holding them; a lookup walks the prompt's levels from the deepest,
so it costs what the prompt's blocks cost, not what the pool costs; where a level is held by
more replicas than there are places, the least loaded of them. Where replicas push KV events it
does the same over their pool-wide holders (:class:`~router.kv_events.BlockHolders`, content key
-> replicas): a prefix another gateway sent is nominated too. It also nominates the replicas
that anchor the eviction term: one with room in its cache and those whose least recently used
blocks are oldest.

Before the decision it attaches :data:`CACHED_TOKENS` -- per candidate, the prompt tokens it
probably has cached -- and :data:`TAIL_AGE` -- per candidate, the seconds since its least
recently used block was last used, ``inf`` while its cache is not full. A new prompt evicts that
tail: the older it is, the less what it evicts is worth (a replica whose cache turns over fast
is under pressure; one with an old tail, or room, is not). It also attaches
:data:`UNCACHED_SHARE` -- per candidate, the share of the prompt tokens recently sent there that
were not cached (a moving average over the last ``share_window`` picks there): the gateway
counts a replica's queued prefill in whole prompts, and this turns it into work. After the pick
it inserts the prompt's blocks into the picked replica's index.

**Exact, where replicas push.** A candidate whose view carries a KV-event index
(:mod:`router.kv_events`) proven current within ``max_staleness_s`` gets :data:`CACHED_TOKENS`
from it instead: the prompt's leading blocks (keyed by its token ids, ``RouteRequest.engine_keys``)
that the engine's cache holds, plus what this gateway sent there in the last ``pending_s``
seconds (routed, not yet scheduled: its blocks are not in the events yet). An index that has not
followed the replica since its cache was empty holds a subset of it; then the larger of it and
the estimate counts. A replica that publishes nothing, a stream older than the bound, or a model
the gateway cannot tokenise, gets the estimate -- never a picture older than the bound. The
decision's notes say ``kv_index``: ``exact``, ``estimate`` or ``mixed`` over the candidates.

**One key per 32 tokens.** The estimate keeps a prompt's blocks every ``index_tokens //
block_tokens`` (every second of the gateway's 16-token chat blocks; every block of a trace's
512-token ones): since a block's key names its whole prefix, the second names the first 32
tokens. A replica's cached run is then counted in whole 32-token steps, and a touch, an eviction
and the index's memory cost half of what a key per block costs (the dict writes after the pick
were the largest part of a decision). Keys of 64 tokens cost less again but lost hits where
replicas publish no KV events (``tidal bench routing --quick --kv-events off --trace synthetic``:
hit ratio 0.739 against 0.750 with a key per block; 0.748 at 32). The exact path below keeps
the engine's own block size.

Parameters: ``capacity_tokens`` (1,048,576: the KV size assumed before a replica's first scrape),
``max_blocks_per_replica`` (524,288: a hard bound on the index's keys whatever a replica
reports), ``max_prefix_blocks`` (4096: blocks of one prompt matched and indexed),
``share_window`` (32), ``max_staleness_s`` (2.0: the bound on the exact index's age),
``pending_s`` (5.0), ``nominees`` (8: prefix holders nominated at pool scale), ``index_tokens``
(32: the prompt tokens one key stands for, at least; 1 keeps every block).

Config example::

    - type: kv-index
      parameters: {capacity_tokens: 2000000}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, ClassVar

import numpy as np
from pydantic import Field
from sortedcontainers import SortedList

from tidal.router.framework import PluginKind
from tidal.router.kv_events import BlockHolders
from tidal.router.lru import ChainLRU, leading_run, run_between
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.pool import Candidates, PoolCandidates
from tidal.router.types import CycleState, ReplicaView, RouteRequest, StateKey

__all__ = [
    "CACHED_TOKENS",
    "KV_INDEX_TYPE",
    "TAIL_AGE",
    "UNCACHED_SHARE",
    "KVIndex",
    "leading_run",
]

KV_INDEX_TYPE = "kv-index"
CACHED_TOKENS: StateKey[dict[str, int]] = StateKey(KV_INDEX_TYPE)
TAIL_AGE: StateKey[dict[str, float]] = StateKey(f"{KV_INDEX_TYPE}.tail_age")
UNCACHED_SHARE: StateKey[dict[str, float]] = StateKey(f"{KV_INDEX_TYPE}.uncached_share")
_RUNS: StateKey[dict[str, int]] = StateKey(f"{KV_INDEX_TYPE}.runs")


class Params(PluginParams):
    capacity_tokens: int = Field(default=1 << 20, ge=1, le=1 << 40)
    max_blocks_per_replica: int = Field(default=1 << 19, ge=1, le=1 << 26)
    max_prefix_blocks: int = Field(default=4096, ge=1, le=1 << 20)
    share_window: int = Field(default=32, ge=1, le=1 << 20)
    max_staleness_s: float = Field(default=2.0, gt=0.0, le=3600.0)
    pending_s: float = Field(default=5.0, ge=0.0, le=3600.0)
    nominees: int = Field(default=8, ge=1, le=1024)
    index_tokens: int = Field(default=32, ge=1, le=1 << 20)


class KVIndex:
    TYPE: ClassVar[str] = KV_INDEX_TYPE
    KIND: ClassVar[PluginKind] = "producer"
    READS_BLOCKS: ClassVar[bool] = True

    def __init__(self, name: str = KV_INDEX_TYPE, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()
        self._keys_at: StateKey[tuple[tuple[int, ...], int]] = StateKey(f"{KV_INDEX_TYPE}.{name}.keys")
        self._lru: dict[str, ChainLRU] = {}
        self._sent: dict[str, tuple[float, float]] = {}  # moving sums: uncached, prompt tokens
        # The inverted index: level block -> bitmask of the replicas holding it.
        self._holders = BlockHolders()
        # Replicas whose cache is full, by the last use of their least recently used block.
        self._tail_of: dict[str, float] = {}
        self._tails = SortedList()  # (tail, name), as of _sorted_as; _moved: names since moved
        self._sorted_as: dict[str, float] = {}
        self._moved: set[str] = set()
        self._full_version = 0  # moves when a replica's cache fills or gets room again
        self._capacity: dict[str, tuple[Any, int, int]] = {}  # name -> (snapshot, block tokens, blocks)

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> KVIndex:
        return cls(name, parse_params(Params, KV_INDEX_TYPE, name, params))

    def capacity(self, replica: ReplicaView, block_tokens: int) -> int:
        """Blocks of ``block_tokens`` the replica's KV cache holds (bounded by the parameters)."""
        # Kept per replica while its snapshot stands (a scrape brings a new one): the decision
        # asks for every candidate's.
        kept = self._capacity.get(replica.name)
        if kept is not None and kept[0] is replica.snapshot and kept[1] == block_tokens:
            return kept[2]
        blocks = replica.kv_blocks(block_tokens)
        if blocks is None:
            blocks = max(1, self.params.capacity_tokens // max(1, block_tokens))
        cap = min(self.params.max_blocks_per_replica, blocks)
        self._capacity[replica.name] = (replica.snapshot, block_tokens, cap)
        if kept is None or kept[2] != cap:
            lru = self._lru.get(replica.name)
            if lru is not None:
                self._retail(replica.name, lru, cap)
        return cap

    def _keys(self, request: RouteRequest, state: CycleState) -> tuple[tuple[int, ...], int]:
        """The prompt's keys in this index (every ``step``-th of its blocks: the key of a block
        names its whole prefix) and the tokens one key stands for; sliced once per decision
        (nominate, produce and after_pick all ask)."""
        keys = state.get(self._keys_at)
        if keys is None:
            bt = max(1, request.block_tokens)
            step = max(1, self.params.index_tokens // bt)
            keys = request.prefix_blocks[step - 1 : self.params.max_prefix_blocks : step], bt * step
            state.put(self._keys_at, keys)
        return keys

    def produce(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        candidates: Sequence[ReplicaView],
        state: CycleState,
    ) -> None:
        blocks, bt = self._keys(request, state)
        tokens = request.prompt_tokens or len(blocks) * bt
        cached: dict[str, int] = {}
        tail_age: dict[str, float] = {}
        share: dict[str, float] = {}
        runs: dict[str, int] = {}  # the estimate's leading run per candidate, for after_pick
        now = state.now
        engine_keys = request.engine_keys
        exact = 0
        lrus, sent_sums, tails, inf = self._lru, self._sent, self._tail_of, math.inf
        capacities = self._capacity
        reverse = blocks[::-1]
        guesses: list[int] = []  # runs found at earlier candidates (see run_between)
        matched: dict[int, tuple[Sequence[int], Callable[[int], int]]] = {}  # (leading_shared)
        first, last, n = (blocks[0], blocks[-1], len(blocks)) if blocks else (0, 0, 0)
        for c in candidates:
            name = c.name
            lru = lrus.get(name)
            if lru is None or not n:
                cached[name] = 0
            else:
                # leading_run, inlined: the decision's hottest loop
                held = lru.held.__contains__
                run = (
                    0 if not held(first) else n if held(last) else run_between(held, blocks, reverse, guesses)
                )
                runs[name] = run
                cached[name] = min(tokens, run * bt)
            # The tail is kept for full caches as of the last insert (a cache changes only then),
            # or as of a new capacity: a scrape that moved it is taken into account here.
            kept = capacities.get(name)
            if kept is None or kept[0] is not c.snapshot or kept[1] != bt:
                self.capacity(c, bt)
            tail = tails.get(name)
            tail_age[name] = inf if tail is None else (now - tail if now > tail else 0.0)
            idx = c.kv_events
            if idx is not None and engine_keys is not None and now - idx.as_of <= self.params.max_staleness_s:
                bs = idx.block_size
                hit = idx.leading_shared(engine_keys(bs), matched) * bs if bs and len(idx) else 0
                if idx.complete:
                    sent = (
                        min(tokens, lru.recent(blocks, now - self.params.pending_s) * bt)
                        if blocks and lru is not None
                        else 0
                    )
                    cached[name] = max(hit, sent)
                else:
                    cached[name] = max(hit, cached[name])
                exact += 1
            uncached, total = sent_sums.get(name, (1.0, 1.0))
            share[name] = uncached / total if total > 0 else 1.0
        if candidates:
            state.notes["kv_index"] = (
                "exact" if exact == len(candidates) else "estimate" if exact == 0 else "mixed"
            )
        state.put(CACHED_TOKENS, cached)
        state.put(TAIL_AGE, tail_age)
        state.put(UNCACHED_SHARE, share)
        state.put(_RUNS, runs)

    def after_pick(self, request: RouteRequest, picked: ReplicaView, state: CycleState) -> None:
        blocks, bt = self._keys(request, state)
        tokens = request.prompt_tokens or len(blocks) * bt
        hit = (state.get(CACHED_TOKENS) or {}).get(picked.name, 0)
        keep = 1.0 - 1.0 / self.params.share_window
        uncached, total = self._sent.get(picked.name, (0.0, 0.0))
        self._sent[picked.name] = (uncached * keep + (tokens - hit), total * keep + tokens)
        if not blocks:
            return
        name = picked.name
        lru = self._lru.get(name)
        if lru is None:
            lru = self._lru[name] = ChainLRU()
        lru.touch(blocks, state.now, (state.get(_RUNS) or {}).get(name))
        holders = self._holders
        bit = holders.bit(name)
        masks, mask = holders.masks, 1 << bit
        for i in _levels(len(blocks)):  # (BlockHolders.add, inlined)
            key = blocks[i]
            masks[key] = masks.get(key, 0) | mask
        cap = self.capacity(picked, bt)
        gone = lru.evict_to(cap)
        if gone:
            # Only the level blocks are in the inverted index: found among the evicted at C speed.
            for b in holders.masks.keys() & gone:
                holders.discard(b, bit)
        self._retail(name, lru, cap)

    def _retail(self, name: str, lru: ChainLRU, cap: int) -> None:
        """Keep ``name``'s tail entry (the last use of its least recently used block, while its
        cache is full at ``cap``) in step with its LRU."""
        tail = lru.oldest() if len(lru) >= cap else None
        old_tail = self._tail_of.get(name)
        if tail == old_tail:
            return
        if old_tail is not None:
            del self._tail_of[name]
        if tail is not None:
            self._tail_of[name] = tail
        self._moved.add(name)
        if (old_tail is None) != (tail is None):
            self._full_version += 1

    def _sorted_tails(self) -> SortedList:
        """The full caches by tail, brought up to date with the tails that moved since last
        asked (only nominations read the order, at pool scale: a small pool never sorts)."""
        tails, sorted_as, tail_of = self._tails, self._sorted_as, self._tail_of
        for name in self._moved:
            old = sorted_as.pop(name, None)
            if old is not None:
                tails.remove((old, name))
            new = tail_of.get(name)
            if new is not None:
                tails.add((new, name))
                sorted_as[name] = new
        self._moved.clear()
        return tails

    def forget(self, replica: str) -> None:
        """``replica`` left the pool: drop its blocks, its bit in the inverted index, its tail and
        its sums (a replica that comes back under the name starts with an empty cache)."""
        lru = self._lru.pop(replica, None)
        holders = self._holders
        bit = holders.bits.get(replica)
        if lru is not None and bit is not None:
            for b in holders.masks.keys() & lru.held.keys():
                holders.discard(b, bit)
        holders.release(replica)
        self._sent.pop(replica, None)
        self._capacity.pop(replica, None)
        if self._tail_of.pop(replica, None) is not None:
            self._moved.add(replica)
            self._full_version += 1

    def nominate(self, request: RouteRequest, candidates: Candidates, state: CycleState) -> Iterable[str]:
        """The candidates holding the longest runs of the prompt, by the estimate and, where
        replicas push KV events, by the events (at most ``nominees`` each; where a level's
        holders are more than the places left, the least loaded of them), the candidates whose
        cache tails are oldest (as many) and one candidate with room in its cache."""
        out: list[str] = []
        blocks, _ = self._keys(request, state)
        limit = self.params.nominees
        _deepest(blocks, self._holders, limit, candidates, out)
        exact = self._exact_holders(request, candidates)
        if exact is not None:
            holders, keys = exact
            _deepest(keys, holders, len(out) + limit, candidates, out)
        tails = 0
        for _, name in self._sorted_tails():  # the oldest tails among the candidates
            if tails >= limit:
                break
            if name in candidates:
                out.append(name)
                tails += 1
        if isinstance(candidates, PoolCandidates) and len(self._tail_of) > 0:
            roomy = self._least_loaded_with_room(candidates)
            if roomy is not None:
                out.append(roomy)
        return out

    def _least_loaded_with_room(self, candidates: PoolCandidates) -> str | None:
        """The least loaded candidate whose cache has room (no tail entry), without walking the
        pool: the pool's replicas with room are kept (in the pool's memo, so membership changes
        clear them) and recounted only when a cache fills or gets room again."""
        pool = candidates.pool
        kept: list[Any] = pool.memo((self.TYPE, id(self), "room"), lambda: [-1, frozenset()])
        if kept[0] != self._full_version:
            tail_of = self._tail_of
            kept[:] = [self._full_version, frozenset(n for n in pool.names() if n not in tail_of)]
        room: frozenset[str] = kept[1]
        if len(room) * _SPARSE > len(pool):  # many: met early walking the load order
            return next(
                filter(candidates.__contains__, filter(room.__contains__, pool.names_by_load())), None
            )
        inside = [n for n in room if n in candidates]
        return min(inside, key=pool.order_key) if inside else None

    @staticmethod
    def _exact_holders(
        request: RouteRequest, candidates: Candidates
    ) -> tuple[BlockHolders, Sequence[int]] | None:
        """The KV events' pool-wide holders and the prompt's keys in their block size, where the
        pool's replicas push events and the prompt could be tokenised."""
        if request.engine_keys is None or not isinstance(candidates, PoolCandidates):
            return None
        pool = candidates.pool
        for name in pool.publishing:  # the first replica with a subscription speaks for the pool
            v = pool.view(name)
            idx = v.kv_events if v is not None else None
            if idx is not None and idx.holders is not None and idx.block_size:
                return idx.holders, request.engine_keys(idx.block_size)
        return None


_SPARSE = 16  # holders of one block under 1/_SPARSE of the pool are sorted by load; more, walked to


def _deepest(
    keys: Sequence[int], holders: BlockHolders, limit: int, candidates: Candidates, out: list[str]
) -> None:
    """Appends to ``out`` (up to ``limit`` in all) the candidates holding the longest runs of
    ``keys``, by ``holders`` (key at a level position -> its holders)."""
    masks, bits = holders.masks, holders.bits
    taken = 0
    for n in out:
        b = bits.get(n)
        if b is not None:
            taken |= 1 << b
    for i in reversed(_levels(len(keys))):
        held = masks.get(keys[i], 0) & ~taken
        if held:
            for name in _least_loaded_of(held, limit - len(out), candidates, holders.names):
                out.append(name)
                taken |= 1 << bits[name]
            if len(out) >= limit:
                return


def _least_loaded_of(held: int, k: int, candidates: Candidates, names: Sequence[str | None]) -> list[str]:
    """Up to ``k`` candidates among the replicas whose bits are set in ``held``, least loaded
    first. Holders that are a large share of the pool are met walking the pool's load order at C
    speed; fewer are listed and sorted."""
    count = held.bit_count()
    if isinstance(candidates, PoolCandidates) and count * _SPARSE > len(candidates.pool):
        # Walked to in the pool's load order at C speed: holders are often the busiest replicas
        # (a prefix draws its conversations there), so the walk can pass most of the pool.
        holding = set(_holder_names(held, names))
        order = filter(holding.__contains__, candidates.pool.names_by_load())
        return list(islice(filter(candidates.__contains__, order), k))
    found: list[str] = []
    if isinstance(candidates, PoolCandidates) and count > _LISTED_IN_C:
        found = candidates.among(_holder_names(held, names))
    else:
        while held:
            low = held & -held
            name = names[low.bit_length() - 1]
            if name is not None and name in candidates:
                found.append(name)
            held ^= low
    if len(found) <= k:
        return found
    if isinstance(candidates, PoolCandidates):
        return sorted(found, key=candidates.pool.order_keys.__getitem__)[:k]  # (a sort in C)
    views = [w for n in found if (w := candidates.view(n)) is not None]
    views.sort(key=lambda w: (w.load, w.prefill_tokens, w.name))
    return [w.name for w in views[:k]]


_LISTED_IN_C = 8  # holders above this many are listed by numpy, not bit by bit


def _holder_names(held: int, names: Sequence[str | None]) -> Iterator[str]:
    """The names of the replicas whose bits are set in ``held`` (freed bits skipped)."""
    return filter(None, map(names.__getitem__, _set_bits(held)))


def _set_bits(held: int) -> list[int]:
    """The positions of the bits set in ``held``, lowest first, at C speed (a pool's mask has
    a bit per replica: thousands)."""
    raw = np.frombuffer(held.to_bytes((held.bit_length() + 7) // 8, "little"), np.uint8)
    positions: list[int] = np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    return positions


_LEVELS = tuple((1 << j) - 1 for j in range(64))


def _levels(n: int) -> tuple[int, ...]:
    """The positions of a prompt's blocks that the inverted index keeps: 0, 1, 3, 7, ... < ``n``."""
    return _LEVELS[: n.bit_length()]
