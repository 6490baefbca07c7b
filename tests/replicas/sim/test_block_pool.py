"""The block pool and its LRU free queue, with a dozen 16-token blocks and exact block ids."""

from __future__ import annotations

import pytest

from tidal.replicas.sim.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_block_zero_is_the_null_block_and_never_handed_out() -> None:
    pool = BlockPool(12)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_ids(pool) == list(range(1, 12))
    assert pool.get_num_free_blocks() == 11 and pool.get_usage() == 0.0


def test_allocation_pops_from_the_front_in_id_order() -> None:
    pool = BlockPool(12)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert free_ids(pool) == list(range(4, 12))
    assert pool.get_usage() == pytest.approx(3 / 11)
    with pytest.raises(ValueError):
        pool.get_new_blocks(9)
    pool.check_invariants()


def test_freed_cached_blocks_go_to_the_tail_and_uncached_to_the_front() -> None:
    # Given a request holding blocks 1-4 whose first three are full and cached
    pool = BlockPool(12)
    blocks = pool.get_new_blocks(4)
    for b, h in zip(blocks[:3], (101, 102, 103), strict=False):
        pool.cache_full_block(b, h)
    # When it finishes (freed tail first, as the manager does)
    pool.free_blocks(reversed(blocks))
    # Then the partial block 4 is reused first and the cached chain is evicted tail first
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 10, 11, 3, 2, 1]
    pool.check_invariants()


def test_eviction_is_lazy_and_in_lru_order() -> None:
    pool = BlockPool(12)
    a = pool.get_new_blocks(2)
    pool.cache_full_block(a[0], 11)
    pool.cache_full_block(a[1], 12)
    pool.free_blocks(reversed(a))  # free queue: 3..11, 2, 1
    # Still findable by hash while free.
    cached = pool.get_cached_block(11)
    assert cached is not None and cached.block_id == 1
    # Taking the 9 uncached blocks evicts nothing; the 10th pops block 2 and evicts hash 12.
    pool.get_new_blocks(9)
    assert pool.num_evictions == 0
    (b,) = pool.get_new_blocks(1)
    assert b.block_id == 2 and pool.get_cached_block(12) is None and pool.num_evictions == 1
    assert pool.get_cached_block(11) is not None
    pool.check_invariants()


def test_touch_takes_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(12)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, 7)
    pool.free_blocks([b])
    assert 1 in free_ids(pool)
    pool.touch([b])
    assert b.ref_cnt == 1 and 1 not in free_ids(pool)
    pool.touch([b])  # a second holder: no queue change
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert 1 not in free_ids(pool)
    pool.free_blocks([b])
    assert free_ids(pool)[-1] == 1
    pool.check_invariants()


def test_duplicate_blocks_stay_findable_until_both_are_evicted() -> None:
    # Two requests computed the same block at the same time: both copies are mapped.
    pool = BlockPool(12)
    x, y = pool.get_new_blocks(2)
    pool.cache_full_block(x, 5)
    pool.cache_full_block(y, 5)
    pool.free_blocks([x, y])
    found = pool.get_cached_block(5)
    assert found is not None and found.block_id == 1
    pool.get_new_blocks(9)  # uncached blocks 3..11 first
    pool.get_new_blocks(1)  # evicts block 1
    found = pool.get_cached_block(5)
    assert found is not None and found.block_id == 2
    pool.get_new_blocks(1)
    assert pool.get_cached_block(5) is None
    pool.check_invariants()


def test_free_queue_remove_and_append_are_constant_time_links() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    q.append(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4, 2]
    assert q.popleft().block_id == 0
    q.prepend_n([blocks[0]])
    assert [b.block_id for b in q.popleft_n(3)] == [0, 1, 3]
    assert q.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])  # not in the queue


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(12)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, 9)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() and pool.get_cached_block(9) is None
