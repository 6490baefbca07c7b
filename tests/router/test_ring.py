"""Consistent hashing with bounded loads: placement, the bound, the clockwise walk."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from tidal.router.ring import HashRing, bounded_choice, stable_hash, walk_to_fit

NAMES = [f"r{i}" for i in range(8)]


def test_keys_spread_over_the_ring_and_stay_put() -> None:
    ring = HashRing(NAMES, virtual_nodes=200)
    homes = Counter(next(ring.walk(stable_hash(str(k).encode()))) for k in range(8000))
    assert set(homes) == set(NAMES)
    assert max(homes.values()) < 1.5 * min(homes.values())
    # The same key always starts at the same replica.
    assert next(ring.walk(42)) == next(HashRing(reversed(NAMES), 200).walk(42))


def test_removing_a_replica_moves_only_its_keys() -> None:
    before = HashRing(NAMES)
    after = HashRing([n for n in NAMES if n != "r3"])
    moved = [k for k in range(2000) if next(before.walk(k)) != next(after.walk(k))]
    assert all(next(before.walk(k)) == "r3" for k in moved)


def test_walk_visits_each_replica_once() -> None:
    order = list(HashRing(NAMES).walk(7))
    assert sorted(order) == sorted(NAMES)


@pytest.mark.parametrize(
    ("home_load", "others", "stays"),
    [
        (0, 0, True),  # idle pool: bound ceil(1.25 * 1 / 4) = 1, home 0 + 1 fits
        (1, 0, False),  # bound ceil(1.25 * 2 / 4) = 1, home 1 + 1 does not fit
        (4, 4, True),  # evenly loaded: bound ceil(1.25 * 17 / 4) = 6, 5 fits
        (6, 4, False),  # bound ceil(1.25 * 19 / 4) = 6, 7 does not fit
    ],
)
def test_bound_counts_the_incoming_request(home_load: float, others: float, stays: bool) -> None:
    ring = HashRing(["a", "b", "c", "d"])
    home = next(ring.walk(99))
    loads = {n: float(others) for n in "abcd"}
    loads[home] = float(home_load)
    choice = bounded_choice(ring, 99, loads)
    assert choice is not None
    assert choice.home == home
    assert (choice.target == home) is stays


def test_overloaded_home_walks_clockwise_to_the_next_replica() -> None:
    ring = HashRing(["a", "b", "c", "d"])
    order = list(ring.walk(12345))
    home, second = order[0], order[1]
    # total = 12, n = 4: bound = ceil(1.25 * 13 / 4) = 5; home has 9 + 1 > 5.
    loads = dict.fromkeys(order, 1.0)
    loads[home] = 9.0
    choice = bounded_choice(ring, 12345, loads)
    assert choice is not None
    assert (choice.home, choice.target, choice.walks) == (home, second, 1)


def test_filtered_replicas_are_skipped_not_counted_as_walks() -> None:
    ring = HashRing(["a", "b", "c"])
    order = list(ring.walk(5))
    loads = {order[1]: 0.0, order[2]: 0.0}  # the ring's first replica is not a candidate
    choice = bounded_choice(ring, 5, loads)
    assert choice is not None
    assert (choice.home, choice.target, choice.walks) == (order[1], order[1], 0)


def test_bounded_load_keeps_the_max_within_the_factor() -> None:
    # Given one very hot key and 8 replicas, When 800 requests arrive without any finishing,
    # Then no replica holds more than ceil(1.25 x average + 1).
    ring = HashRing(NAMES)
    loads = dict.fromkeys(NAMES, 0.0)
    for _ in range(800):
        choice = bounded_choice(ring, 777, loads)
        assert choice is not None
        loads[choice.target] += 1
    assert max(loads.values()) <= 1.25 * 100 + 1


def test_work_bound_keeps_an_idle_pool_home_and_spreads_queued_prefill() -> None:
    from tidal.router.ring import bounded_cost_choice

    ring = HashRing(["a", "b", "c", "d"])
    order = list(ring.walk(42))
    # Given an idle pool, a 10k-token prompt costs 10k everywhere: it stays on its ring replica.
    idle = dict.fromkeys("abcd", 10_000.0)
    choice = bounded_cost_choice(ring, 42, idle)
    assert choice is not None and (choice.target, choice.walks) == (order[0], 0)
    # Given 40k prefill tokens queued on that replica, 50k > 1.25 x mean (20k): it walks on.
    busy = dict(idle)
    busy[order[0]] = 50_000.0
    choice = bounded_cost_choice(ring, 42, busy)
    assert choice is not None and (choice.home, choice.target, choice.walks) == (order[0], order[1], 1)
    # A replica that holds most of the prompt (cheap there) is preferred even when busier.
    warm = dict(idle)
    warm[order[2]] = 8_000.0 + 1_000.0  # 8k queued + 1k uncached
    choice = bounded_cost_choice(ring, 42, warm, prefer=order[2])
    assert choice is not None and choice.target == order[2]


def _walk_to_fit_by_the_definition(ring, key, is_candidate, fits, prefer=None):  # type: ignore[no-untyped-def]
    """The walk as its docstring defines it: ``prefer`` first when it is a candidate, then the
    ring's candidates in clockwise order, each once; the first that fits."""
    order = [n for n in ring.walk(key) if is_candidate(n)]
    home = order[0] if order else None
    if prefer is not None and is_candidate(prefer):
        order = [prefer] + [n for n in order if n != prefer]
    for walks, name in enumerate(order):
        if fits(name):
            return name, home, walks
    return None, home, len(order)


@settings(max_examples=300, deadline=None)
@given(
    key=st.integers(0, 2**64 - 1),
    candidates=st.sets(st.sampled_from(NAMES)),
    fitting=st.sets(st.sampled_from(NAMES)),
    prefer=st.one_of(st.none(), st.sampled_from(NAMES)),
)
def test_the_walk_is_the_one_its_definition_gives(
    key: int, candidates: set[str], fitting: set[str], prefer: str | None
) -> None:
    ring = HashRing(NAMES, virtual_nodes=20)
    assert walk_to_fit(ring, key, candidates.__contains__, fitting.__contains__, prefer) == (
        _walk_to_fit_by_the_definition(ring, key, candidates.__contains__, fitting.__contains__, prefer)
    )
