"""BlockLRU keeps an OrderedDict's LRU semantics (touch, evict, oldest) however its log is
compacted."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings, strategies as st

from tidal.router import lru as lru_module
from tidal.router.lru import BlockLRU

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
