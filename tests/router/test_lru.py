"""BlockLRU keeps an OrderedDict's LRU semantics (touch, evict, oldest) however its log is
compacted."""

from __future__ import annotations

import math
import sys
from collections import OrderedDict, deque
from collections.abc import Iterator

from hypothesis import given, settings, strategies as st

from tidal.router import lru as lru_module
from tidal.router.lru import BlockLRU, ChainLRU, leading_run

_touch = st.lists(st.integers(0, 40), min_size=0, max_size=12, unique=True).map(lambda ks: ("touch", ks))
_evict = st.integers(0, 30).map(lambda cap: ("evict", cap))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_touch, _evict), max_size=120))
def test_block_lru_matches_an_ordered_dict(ops: list[tuple[str, object]]) -> None:
    lru_module._COMPACT_MIN = 4  # compact often (restored below)
    try:
        lru, ref = BlockLRU(), OrderedDict[int, float]()
        now = 0.0
        for op, arg in ops:
            now += 1.0
            if op == "touch":
                assert isinstance(arg, list)
                lru.touch(arg, now)
                for k in arg:
                    ref.pop(k, None)
                    ref[k] = now
            else:
                assert isinstance(arg, int)
                expected = []
                while len(ref) > arg:
                    expected.append(ref.popitem(last=False)[0])
                assert lru.evict_to(arg) == expected
            assert len(lru) == len(ref)
            assert dict(lru.held) == dict(ref)
            assert lru.oldest() == (next(iter(ref.values())) if ref else None)
    finally:
        lru_module._COMPACT_MIN = 4096


def test_a_touch_in_the_same_instant_still_orders_after_the_previous_one() -> None:
    lru = BlockLRU()
    lru.touch([1, 2], 5.0)
    lru.touch([1], 5.0)
    assert lru.evict_to(1) == [2]
    assert list(lru.held) == [1]


def _chain(base: list[int], extend: list[int]) -> list[int]:
    """``base`` then keys that name their prefix, as block hashes do."""
    out = list(base)
    for x in extend:
        out.append(hash((tuple(out), x)) & (2**64 - 1))
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("touch"),
                st.integers(0, 50),
                st.integers(0, 8),
                st.lists(st.integers(0, 3), max_size=6),
            ),
            st.tuples(st.just("evict"), st.integers(0, 30), st.just(0), st.just([])),
        ),
        max_size=100,
    )
)
def test_chain_lru_is_a_block_lru_touched_last_to_first(ops: list[tuple[str, int, int, list[int]]]) -> None:
    """On keys that chain, ChainLRU evicts exactly what BlockLRU evicts when each chain is touched
    from its last key to its first, and answers the leading and recent runs the same."""
    lru_module._COMPACT_MIN = 4  # compact the log and the key array often (restored below)
    lru_module._DICT_CHECK = 4  # and consider rebuilding the key dict often
    try:
        lru, ref = ChainLRU(), BlockLRU()
        chains: list[list[int]] = []
        now = 0.0
        for op, a, b, extend in ops:
            now += 1.0
            if op == "touch":
                base = chains[a % len(chains)] if chains and a else []
                chain = _chain(base[: b % (len(base) + 1)], extend)
                chains.append(chain)
                # the caller's run when it has one: right, absent, or wrong (then not trusted)
                hint = (None, lru.leading(chain), b)[a % 3]
                lru.touch(chain, now, hint)
                ref.touch(chain[::-1], now)
            else:
                assert lru.evict_to(a) == ref.evict_to(a)
            assert len(lru) == len(ref)
            assert set(lru.held) == set(ref.held)
            assert lru.oldest() == ref.oldest()
            for chain in chains[-4:]:
                assert lru.leading(chain) == leading_run(ref.held, chain)
                for since in (now - 2, now - 8):
                    expected = 0
                    while expected < len(chain) and ref.held.get(chain[expected], -math.inf) >= since:
                        expected += 1
                    assert lru.recent(chain, since) == expected
    finally:
        lru_module._COMPACT_MIN = 4096
        lru_module._DICT_CHECK = 4096


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.lists(st.integers(0, 12), max_size=8).map(lambda ks: ("touch", ks)),
            st.integers(0, 10).map(lambda cap: ("evict", cap)),
        ),
        max_size=80,
    )
)
def test_chain_lru_stays_bounded_on_keys_that_do_not_chain(ops: list[tuple[str, object]]) -> None:
    """Keys that repeat or cross (never, for block hashes) end neither in a loop nor beyond the
    capacity, and the LRU knows its oldest key whenever it holds any."""
    lru_module._COMPACT_MIN = 4
    try:
        lru = ChainLRU()
        for i, (op, arg) in enumerate(ops):
            if op == "touch":
                assert isinstance(arg, list)
                lru.touch(arg, float(i // 2))
            else:
                assert isinstance(arg, int)
                lru.evict_to(arg)
                assert len(lru) <= arg
            assert (lru.oldest() is None) == (len(lru) == 0)
    finally:
        lru_module._COMPACT_MIN = 4096


def test_a_full_chain_lru_keeps_its_key_dict_at_the_size_a_copy_gives() -> None:
    """At a replica's full KV size (89,730 blocks), churned, the key dict takes the table a copy
    of it would (2^18 slots on CPython), not the twice larger one CPython's own growth picks for
    more than 87,381 keys; a plain dict churned alike is the yardstick."""
    lru, plain, fifo = ChainLRU(), dict[int, int](), deque[int]()
    for i, chain in enumerate(_churn(5)):
        lru.touch(chain, float(i))
        lru.evict_to(_CAPACITY)
        plain.update(dict.fromkeys(chain, 0))
        fifo.extend(chain)
        while len(plain) > _CAPACITY:
            del plain[fifo.popleft()]
    assert len(lru) == len(plain) == _CAPACITY
    assert sys.getsizeof(lru.held) < 0.6 * sys.getsizeof(plain)


def test_a_full_chain_lru_keeps_its_key_array_within_a_quarter_of_its_keys() -> None:
    """Churned at a replica's full KV size, the key array (live keys, dead ones and room) stays
    within about a quarter over the live keys: it is a large part of a full index."""
    lru = ChainLRU()
    worst = 0
    for i, chain in enumerate(_churn(3)):
        lru.touch(chain, float(i))
        lru.evict_to(_CAPACITY)
        worst = max(worst, len(lru._keys))
    assert len(lru) == _CAPACITY
    assert _CAPACITY < worst <= 1.4 * _CAPACITY


_CAPACITY = 89_730  # a replica's full KV size in blocks


def _churn(times: int, prompt: int = 64) -> Iterator[list[int]]:
    """Chains of ``prompt`` new keys each (block hashes' 60 bits), ``times`` x a full index."""
    for i in range(times * _CAPACITY // prompt):
        yield [((i * prompt + j) * 0x9E3779B97F4A7C15) % 2**60 for j in range(prompt)]
