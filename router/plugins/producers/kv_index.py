"""``kv-index``: per replica, the prompt blocks it probably still holds in its KV cache.

The gateway cannot see a replica's prefix cache, but it knows every prompt it sent there. This
index keeps, per replica, the chained block hashes of those prompts (:mod:`router.prefix`; a
block hash names its whole prefix) in an LRU the size of the replica's KV cache (its scraped
``vllm:cache_config_info``: ``num_gpu_blocks x block_size`` tokens, else ``capacity_tokens``), so
a replica that takes many long prompts forgets old ones as its engine would. A prompt's blocks
are touched from last to first, like vLLM frees them: the shared head of a conversation stays
the most recent, its tail goes first, and what the index holds of any chain is a prefix of it.
That lets the match be a binary search: ``O(log blocks)`` per candidate, so a decision costs
``O(replicas x log blocks)``.

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

Parameters: ``capacity_tokens`` (1,048,576: the KV size assumed before a replica's first scrape),
``max_blocks_per_replica`` (524,288: a hard bound on the index's memory whatever a replica
reports), ``max_prefix_blocks`` (4096: blocks of one prompt matched and indexed),
``share_window`` (32), ``max_staleness_s`` (2.0: the bound on the exact index's age),
``pending_s`` (5.0).

Config example::

    - type: kv-index
      parameters: {capacity_tokens: 2000000}
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from router.framework import PluginKind
from router.plugins.base import PluginParams, parse_params
from router.types import CycleState, ReplicaView, RouteRequest, StateKey

__all__ = [
    "CACHED_TOKENS",
    "KV_INDEX_TYPE",
    "TAIL_AGE",
    "UNCACHED_SHARE",
    "KVIndex",
    "leading_run",
    "recent_run",
]

KV_INDEX_TYPE = "kv-index"
CACHED_TOKENS: StateKey[dict[str, int]] = StateKey(KV_INDEX_TYPE)
TAIL_AGE: StateKey[dict[str, float]] = StateKey(f"{KV_INDEX_TYPE}.tail_age")
UNCACHED_SHARE: StateKey[dict[str, float]] = StateKey(f"{KV_INDEX_TYPE}.uncached_share")


class Params(PluginParams):
    capacity_tokens: int = Field(default=1 << 20, ge=1, le=1 << 40)
    max_blocks_per_replica: int = Field(default=1 << 19, ge=1, le=1 << 26)
    max_prefix_blocks: int = Field(default=4096, ge=1, le=1 << 20)
    share_window: int = Field(default=32, ge=1, le=1 << 20)
    max_staleness_s: float = Field(default=2.0, gt=0.0, le=3600.0)
    pending_s: float = Field(default=5.0, ge=0.0, le=3600.0)


def leading_run(held: Mapping[int, Any], blocks: Sequence[int]) -> int:
    """How many of ``blocks`` lead the sequence inside ``held``, assuming what is held of the
    chain is a prefix of it (binary search)."""
    lo, hi = 0, len(blocks)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def recent_run(held: Mapping[int, float], blocks: Sequence[int], since: float) -> int:
    """How many of ``blocks`` lead the sequence inside ``held`` with a last use at or after
    ``since``."""
    n = 0
    for b in blocks:
        t = held.get(b)
        if t is None or t < since:
            break
        n += 1
    return n


class KVIndex:
    TYPE: ClassVar[str] = KV_INDEX_TYPE
    KIND: ClassVar[PluginKind] = "producer"
    READS_BLOCKS: ClassVar[bool] = True

    def __init__(self, name: str = KV_INDEX_TYPE, params: Params | None = None) -> None:
        self.name = name
        self.params = params or Params()
        self._lru: dict[str, OrderedDict[int, float]] = {}  # block -> last use, LRU first
        self._sent: dict[str, tuple[float, float]] = {}  # moving sums: uncached, prompt tokens

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> KVIndex:
        return cls(name, parse_params(Params, KV_INDEX_TYPE, name, params))

    def capacity(self, replica: ReplicaView, block_tokens: int) -> int:
        """Blocks of ``block_tokens`` the replica's KV cache holds (bounded by the parameters)."""
        blocks = replica.kv_blocks(block_tokens)
        if blocks is None:
            blocks = max(1, self.params.capacity_tokens // max(1, block_tokens))
        return min(self.params.max_blocks_per_replica, blocks)

    def produce(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        candidates: Sequence[ReplicaView],
        state: CycleState,
    ) -> None:
        blocks = request.prefix_blocks[: self.params.max_prefix_blocks]
        bt = max(1, request.block_tokens)
        tokens = request.prompt_tokens or len(blocks) * bt
        empty: OrderedDict[int, float] = OrderedDict()
        cached: dict[str, int] = {}
        tail_age: dict[str, float] = {}
        now = state.now
        engine_keys = request.engine_keys
        exact = 0
        for c in candidates:
            lru = self._lru.get(c.name, empty)
            est = min(tokens, leading_run(lru, blocks) * bt) if blocks else 0
            idx = c.kv_events
            if idx is not None and engine_keys is not None and now - idx.as_of <= self.params.max_staleness_s:
                bs = idx.block_size
                hit = idx.leading(engine_keys(bs)) * bs if bs and len(idx) else 0
                if idx.complete:
                    sent = (
                        min(tokens, recent_run(lru, blocks, now - self.params.pending_s) * bt)
                        if blocks
                        else 0
                    )
                    est = max(hit, sent)
                else:
                    est = max(hit, est)
                exact += 1
            cached[c.name] = est
            if len(lru) < self.capacity(c, bt):
                tail_age[c.name] = math.inf
            else:
                tail_age[c.name] = max(0.0, now - next(iter(lru.values())))
        if candidates:
            state.notes["kv_index"] = (
                "exact" if exact == len(candidates) else "estimate" if exact == 0 else "mixed"
            )
        state.put(CACHED_TOKENS, cached)
        state.put(TAIL_AGE, tail_age)
        share: dict[str, float] = {}
        for c in candidates:
            uncached, total = self._sent.get(c.name, (1.0, 1.0))
            share[c.name] = uncached / total if total > 0 else 1.0
        state.put(UNCACHED_SHARE, share)

    def after_pick(self, request: RouteRequest, picked: ReplicaView, state: CycleState) -> None:
        blocks = request.prefix_blocks[: self.params.max_prefix_blocks]
        tokens = request.prompt_tokens or len(blocks) * max(1, request.block_tokens)
        hit = (state.get(CACHED_TOKENS) or {}).get(picked.name, 0)
        keep = 1.0 - 1.0 / self.params.share_window
        uncached, total = self._sent.get(picked.name, (0.0, 0.0))
        self._sent[picked.name] = (uncached * keep + (tokens - hit), total * keep + tokens)
        if not blocks:
            return
        lru = self._lru.setdefault(picked.name, OrderedDict())
        for b in reversed(blocks):
            lru[b] = state.now
            lru.move_to_end(b)
        cap = self.capacity(picked, max(1, request.block_tokens))
        while len(lru) > cap:
            lru.popitem(last=False)
