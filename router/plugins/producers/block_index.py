"""``approx-prefix-index`` and ``radix-tree``: what each replica has probably cached, guessed from
where the router sent earlier prompts.

Both keep, per replica, the chained block hashes of the prompts routed there
(:func:`router.prefix.text_blocks`; a block hash names its whole prefix, so a set of them is a
prefix tree). Before the decision they attach to the cycle state, for each candidate, the share
of the request's leading blocks found in its index; after the pick they insert the request's
blocks into the picked replica's index.

* ``approx-prefix-index`` -- llm-d's approximate prefix producer: an LRU per replica
  (:class:`~router.lru.BlockLRU`, which the garbage collector does not walk) sized to
  the replica's KV cache (``num_gpu_blocks x block_size`` from its scraped
  ``vllm:cache_config_info``, else ``lru_capacity_per_server`` blocks), matching at most
  ``max_prefix_blocks``. Parameters: ``lru_capacity_per_server`` (31250), ``max_prefix_blocks`` (256).
* ``radix-tree`` -- SGLang's approximate tree: no size tie to the KV cache; every
  ``eviction_interval_s`` (120) the least recently used entries beyond ``max_tree_blocks``
  (1,048,576, SGLang's 64 Mi characters in 64-character blocks) are dropped. It also reports each
  tree's size (SGLang sends cache misses to the smallest tree). SGLang's tree works on
  characters; this one on 64-character blocks, a close approximation for prompts of any length.

Config example::

    - type: approx-prefix-index
      parameters: {lru_capacity_per_server: 31250}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from tidal.router.framework import PluginKind
from tidal.router.lru import BlockLRU
from tidal.router.plugins.base import PluginParams, parse_params
from tidal.router.types import CycleState, ReplicaView, RouteRequest, StateKey

__all__ = [
    "INDEX_MATCH",
    "INDEX_TYPE",
    "TREE_FACTS",
    "TREE_TYPE",
    "ApproxPrefixIndex",
    "RadixTree",
    "TreeFacts",
]

INDEX_TYPE = "approx-prefix-index"
TREE_TYPE = "radix-tree"
INDEX_MATCH: StateKey[dict[str, float]] = StateKey(INDEX_TYPE)


@dataclass(frozen=True, slots=True)
class TreeFacts:
    """Per candidate: share of the request's blocks matched, and the tree's size in blocks."""

    match: dict[str, float]
    size: dict[str, int]


TREE_FACTS: StateKey[TreeFacts] = StateKey(TREE_TYPE)


def _leading_matches(index: Mapping[int, Any], blocks: Sequence[int]) -> int:
    n = 0
    for b in blocks:
        if b not in index:
            break
        n += 1
    return n


class IndexParams(PluginParams):
    lru_capacity_per_server: int = Field(default=31250, ge=1, le=1 << 30)
    max_prefix_blocks: int = Field(default=256, ge=1, le=1 << 20)


class ApproxPrefixIndex:
    TYPE: ClassVar[str] = INDEX_TYPE
    KIND: ClassVar[PluginKind] = "producer"
    READS_BLOCKS: ClassVar[bool] = True

    def __init__(self, name: str = INDEX_TYPE, params: IndexParams | None = None) -> None:
        self.name = name
        self.params = params or IndexParams()
        self._lru: dict[str, BlockLRU] = {}

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> ApproxPrefixIndex:
        return cls(name, parse_params(IndexParams, INDEX_TYPE, name, params))

    def _capacity(self, replica: ReplicaView, block_tokens: int) -> int:
        blocks = replica.kv_blocks(block_tokens)
        return blocks if blocks is not None else self.params.lru_capacity_per_server

    def produce(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        candidates: Sequence[ReplicaView],
        state: CycleState,
    ) -> None:
        blocks = request.prefix_blocks[: self.params.max_prefix_blocks]
        if not blocks:
            return
        lrus = self._lru
        state.put(
            INDEX_MATCH,
            {
                c.name: _leading_matches(lru.held, blocks) / len(blocks) if (lru := lrus.get(c.name)) else 0.0
                for c in candidates
            },
        )

    def forget(self, replica: str) -> None:
        """``replica`` left the pool: its index goes."""
        self._lru.pop(replica, None)

    def after_pick(self, request: RouteRequest, picked: ReplicaView, state: CycleState) -> None:
        blocks = request.prefix_blocks[: self.params.max_prefix_blocks]
        if not blocks:
            return
        lru = self._lru.get(picked.name)
        if lru is None:
            lru = self._lru[picked.name] = BlockLRU()
        lru.touch(blocks, state.now)
        lru.evict_to(self._capacity(picked, request.block_tokens))


class TreeParams(PluginParams):
    max_tree_blocks: int = Field(default=1 << 20, ge=1, le=1 << 32)
    eviction_interval_s: float = Field(default=120.0, gt=0)


class RadixTree:
    TYPE: ClassVar[str] = TREE_TYPE
    KIND: ClassVar[PluginKind] = "producer"
    READS_BLOCKS: ClassVar[bool] = True

    def __init__(self, name: str = TREE_TYPE, params: TreeParams | None = None) -> None:
        self.name = name
        self.params = params or TreeParams()
        self._trees: dict[str, dict[int, float]] = {}
        self._last_eviction: float | None = None

    @classmethod
    def from_config(cls, name: str, params: Mapping[str, Any] | None = None) -> RadixTree:
        return cls(name, parse_params(TreeParams, TREE_TYPE, name, params))

    def produce(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        candidates: Sequence[ReplicaView],
        state: CycleState,
    ) -> None:
        blocks = request.prefix_blocks
        empty: dict[int, float] = {}
        match = {
            c.name: (
                _leading_matches(self._trees.get(c.name, empty), blocks) / len(blocks) if blocks else 0.0
            )
            for c in candidates
        }
        size = {c.name: len(self._trees.get(c.name, empty)) for c in candidates}
        state.put(TREE_FACTS, TreeFacts(match, size))

    def forget(self, replica: str) -> None:
        """``replica`` left the pool: its tree goes."""
        self._trees.pop(replica, None)

    def after_pick(self, request: RouteRequest, picked: ReplicaView, state: CycleState) -> None:
        tree = self._trees.setdefault(picked.name, {})
        for b in request.prefix_blocks:
            tree[b] = state.now
        if self._last_eviction is None:
            self._last_eviction = state.now
        elif state.now - self._last_eviction >= self.params.eviction_interval_s:
            self._last_eviction = state.now
            self._evict()

    def _evict(self) -> None:
        cap = self.params.max_tree_blocks
        for name, tree in self._trees.items():
            if len(tree) > cap:
                keep = sorted(tree.items(), key=lambda kv: kv[1])[len(tree) - cap :]
                self._trees[name] = dict(keep)
