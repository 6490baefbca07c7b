"""Paged KV blocks: the block pool, its intrusive LRU free list and the prefix-cache map.

Copied in shape from vLLM v1 (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``):

* a ``KVCacheBlock`` per physical block, with a reference count and, once full, a chained hash;
* ``FreeKVCacheBlockQueue``: a doubly linked list threaded through the blocks themselves, least
  recently used at the front, so that allocating, freeing and taking a cached block out of the
  free list are O(1) and allocate no Python objects;
* ``BlockPool``: block 0 is the null block (never handed out); a cached block whose reference
  count drops to 0 stays findable by its hash until ``get_new_blocks`` pops it for reuse, at
  which point its hash is evicted (eviction is lazy, at allocation time).

Example::

    pool = BlockPool(num_gpu_blocks=12, enable_caching=True)
    blocks = pool.get_new_blocks(3)          # block ids 1, 2, 3
    pool.cache_full_block(blocks[0], h)      # findable by hash h
    pool.free_blocks(reversed(blocks))       # hashed blocks go to the tail, others to the front

With ``enable_kv_cache_events`` the pool queues vLLM's KV events as vLLM's pool does: a
``BlockRemoved`` when ``get_new_blocks`` evicts a cached block (one hash per event), an
``AllBlocksCleared`` on a successful reset; ``BlockStored`` comes from the KV-cache manager when
it caches full blocks. ``take_events`` hands them over once per engine step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tidal.replicas.wire.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, KVCacheEvent

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]


class KVCacheBlock:
    """One physical KV block."""

    __slots__ = (
        "block_hash",
        "block_id",
        "ext_hash",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # The chained hash of the block's tokens; set only when the block is full and cached.
        self.block_hash: int | None = None
        # The hash KV events named it by (vLLM's scheme), while cached with events enabled.
        self.ext_hash: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order: least recently used at the front.

    Two fake blocks bound the list so that no operation branches on emptiness. Initially the
    blocks are in id order. Freed blocks that hold a cached hash are appended (evicted last);
    blocks without one are prepended (reused first, as vLLM does for GPU locality).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(1, len(blocks)):
            blocks[i].prev_free_block = blocks[i - 1]
            blocks[i - 1].next_free_block = blocks[i]
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        if blocks:
            self.fake_head.next_free_block = blocks[0]
            blocks[0].prev_free_block = self.fake_head
            self.fake_tail.prev_free_block = blocks[-1]
            blocks[-1].next_free_block = self.fake_tail
        else:
            self.fake_head.next_free_block = self.fake_tail
            self.fake_tail.prev_free_block = self.fake_head

    def popleft(self) -> KVCacheBlock:
        block = self.fake_head.next_free_block
        if block is None or block is self.fake_tail:
            raise ValueError("no free blocks")
        nxt = block.next_free_block
        assert nxt is not None
        self.fake_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n <= 0:
            return []
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} of {self.num_free_blocks} free blocks")
        ret = []
        block = self.fake_head.next_free_block
        for _ in range(n):
            assert block is not None
            ret.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self.fake_head.next_free_block = block
        block.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of a block that is not free: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.fake_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        last = self.fake_tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        first = self.fake_head.next_free_block
        assert first is not None
        prev = self.fake_head
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks front to back (for tests and invariant checks)."""
        ret = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            ret.append(block)
            block = block.next_free_block
        return ret


class BlockPool:
    """All KV blocks of one replica, the free queue and the hash -> block map of cached blocks.

    Two requests that compute the same block at the same time both keep their own copy (block
    tables are append-only, as in vLLM); the map then holds both, and a lookup returns the first.
    """

    def __init__(
        self, num_gpu_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("a block pool needs at least 2 blocks (one is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> block, or hash -> {block_id: block} when duplicates exist.
        self.cached_block_hash_to_block: dict[int, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # Block 0 is a placeholder that is never freed nor handed out.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.num_evictions = 0
        self.kv_event_queue: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    # -- lookups ---------------------------------------------------------------------------------

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        hit = self.cached_block_hash_to_block.get(block_hash)
        if hit is None or isinstance(hit, KVCacheBlock):
            return hit
        return next(iter(hit.values()))

    # -- allocation ------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (the null block does not count)."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.free_block_queue.num_free_blocks / total

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the front of the free queue, evicting any hash they still hold."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        cache = self.cached_block_hash_to_block
        events = self.kv_event_queue
        for block in ret:
            h = block.block_hash
            if h is not None:
                if cache.get(h) is block:  # the common case, inlined: no duplicates
                    del cache[h]
                    block.block_hash = None
                    self.num_evictions += 1
                else:
                    self._evict(block)
                if events is not None and block.ext_hash is not None:
                    events.append(BlockRemoved(block_hashes=[block.ext_hash], medium=MEDIUM_GPU, group_idx=0))
                    block.ext_hash = None
            block.ref_cnt = 1
        return ret

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        assert h is not None
        block.block_hash = None
        self.num_evictions += 1
        hit = self.cached_block_hash_to_block.get(h)
        if hit is block:
            del self.cached_block_hash_to_block[h]
        elif isinstance(hit, dict):
            hit.pop(block.block_id, None)
            if len(hit) == 1:
                self.cached_block_hash_to_block[h] = next(iter(hit.values()))
            elif not hit:
                del self.cached_block_hash_to_block[h]

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Record that ``block`` (full) holds the tokens hashed to ``block_hash``."""
        if block.block_hash is not None:
            return  # already cached (a prefix hit, or cached earlier)
        block.block_hash = block_hash
        cache = self.cached_block_hash_to_block
        hit = cache.get(block_hash)
        if hit is None:
            cache[block_hash] = block
        elif isinstance(hit, KVCacheBlock):
            cache[block_hash] = {hit.block_id: hit, block.block_id: block}
        else:
            hit[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit takes a reference; a free (evictable) block leaves the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, ordered by eviction priority (first = evicted first).

        Blocks that reach zero references rejoin the free queue: cached ones at the tail (LRU),
        uncached ones at the front (they can never be hit, so they are reused first).
        """
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            n = block.ref_cnt - 1
            block.ref_cnt = n
            if n == 0 and not block.is_null:
                if block.block_hash is None or not caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        if evict_first:
            self.free_block_queue.prepend_n(evict_first)
        if evict_last:
            self.free_block_queue.append_n(evict_last)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_gpu_blocks - 1:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
            block.ext_hash = None
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events queued since the last call (empty when events are off)."""
        events = self.kv_event_queue
        if not events:
            return []
        self.kv_event_queue = []
        return events

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (tests call this after every step)."""
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.free_block_queue.num_free_blocks, "free count out of sync"
        assert all(b.ref_cnt == 0 and not b.is_null for b in free), "a free block is referenced"
        free_ids = {b.block_id for b in free}
        for b in self.blocks[1:]:
            assert b.ref_cnt >= 0, f"negative ref count {b}"
            assert (b.ref_cnt == 0) == (b.block_id in free_ids), f"{b} free-list membership wrong"
        for h, hit in self.cached_block_hash_to_block.items():
            for b in [hit] if isinstance(hit, KVCacheBlock) else hit.values():
                assert b.block_hash == h, f"{b} mapped under a hash it does not hold"
