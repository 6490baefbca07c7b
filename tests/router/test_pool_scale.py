"""Routing at pool scale decides on nominees; these tests pin that it decides as the full scan
would. The pool, its load and its prompts are the router-scale benchmark's (simulated engines'
scrapes, chat prompts keyed as the gateway keys them)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry

from tidal.bench import router_scale as rs
from tidal.bench.routing import bench_fleet
from tidal.clock import ManualClock
from tidal.replicas.metrics import LoadSnapshot
from tidal.replicas.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tidal.router.kv_events import BlockHolders, PromptKeys, ReplicaBlockIndex
from tidal.router.loader import build_router
from tidal.router.metrics import RouterMetrics
from tidal.router.plugins.producers.kv_index import KVIndex, Params as KVParams, _set_bits
from tidal.router.pool import PoolCandidates, PoolIndex
from tidal.router.profiles import BUILTIN_PROFILES
from tidal.router.registry import ReplicaRegistry
from tidal.router.types import CycleState, RouteRequest


def _agreement(replicas: int, requests: int, seed: int) -> dict[str, float]:
    """Routes a stream of chat requests through the ``tidal`` profile of a pool of ``replicas``,
    each decision twice on the same state: the full scan (its producers' after-pick hooks muted,
    the tie-break RNG rewound) and the nominees' decision that the stream then follows."""
    clock = ManualClock()
    fleet = bench_fleet(replicas)
    registry = ReplicaRegistry.from_fleet(fleet, clock)
    router = build_router(fleet.router, clock=clock, seed=seed, observer=RouterMetrics(CollectorRegistry()))
    rng = random.Random(seed)
    states = registry.in_pool(rs.POOL)
    profile = router.profiles["tidal"]
    assert profile.narrows()
    same = nominated = 0
    regrets: list[float] = []
    running = []
    for i, request in enumerate(rs._requests(bench_fleet(1), requests, seed)):
        clock.advance(0.01)
        if i % 50 == 0:
            rs._scrape(registry, states, rng)
        views = registry.views(rs.POOL)
        assert isinstance(views, PoolIndex) and len(views) > profile.narrow_above
        rewind = router.rng.getstate()
        hooks = [(p, p.after_pick) for p in profile.producers]
        for p, _ in hooks:
            p.after_pick = lambda *_a, **_k: None  # type: ignore[method-assign]
        profile.narrow_above, narrow_above = 1 << 30, profile.narrow_above
        try:
            full = router.route(request, views, profile="tidal")
        finally:
            profile.narrow_above = narrow_above
            for p, hook in hooks:
                p.after_pick = hook  # type: ignore[method-assign]
        router.rng.setstate(rewind)
        got = router.route(request, views, profile="tidal")
        assert full is not None and got is not None
        winner = full.replica.name
        same += got.replica.name == winner
        nominated += winner in got.scores
        # what the nominees' pick loses by the full scan's own scores (total weight 23.25)
        regrets.append(full.scores[winner] - full.scores[got.replica.name])
        state = registry.get(got.replica.name)
        assert state is not None
        registry.acquire(state, None, request.prompt_tokens)
        running.append(state)
        if len(running) > 4 * replicas:
            registry.release(running.pop(0), tpot_s=0.03)
    regrets.sort()
    return {
        "same": same / requests,
        "nominated": nominated / requests,
        "regret_p99": regrets[int(0.99 * len(regrets))],
        "regret_max": regrets[-1],
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_the_nominees_decide_as_the_full_scan_would(seed: int) -> None:
    # Given a pool of 160 replicas (above narrow_above) and a stream of growing conversations,
    facts = _agreement(replicas=160, requests=500, seed=seed)
    print(facts)
    # Then the full scan's winner is nearly always among the nominees and picked,
    assert facts["nominated"] >= 0.93 and facts["same"] >= 0.9, facts
    # and where it is not, the pick's score by the full scan is within a fraction of one
    # weight point of the winner's (prefill cost normalises over the candidates it scores).
    assert facts["regret_p99"] <= 0.5 and facts["regret_max"] <= 1.0, facts


def test_only_profiles_whose_plugins_allow_it_decide_on_nominees() -> None:
    clock = ManualClock()
    router = build_router(bench_fleet(8).router, clock=clock, seed=0)
    narrowing = {name for name in BUILTIN_PROFILES if router.profiles[name].narrows()}
    # The anchors keep their own algorithms over every candidate.
    assert narrowing == {"tidal"}


# -- the KV events' pool-wide holders ---------------------------------------------------------------


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        lora_id=None,
        lora_name=None,
        medium="GPU",
        block_size=4,
    )


def _apply(idx: ReplicaBlockIndex, *events: object) -> None:
    idx.apply(KVEventBatch(0.0, list(events), 0))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["store", "remove", "clear"]), st.integers(0, 5)))
)
def test_the_holders_are_the_union_of_the_replicas_indexes(ops: list[tuple[int, str, int]]) -> None:
    # Given three replicas' indexes sharing one holders map,
    holders = BlockHolders()
    indexes = []
    for name in ("a", "b", "c"):
        idx = ReplicaBlockIndex()
        idx.reset(complete=True)
        idx.share(holders, holders.bit(name))
        indexes.append(idx)
    # whatever their events (chains of 1-6 blocks stored twice over, removed, cleared),
    for replica, op, n in ops:
        idx = indexes[replica]
        if op == "store":
            _apply(idx, _stored(list(range(10, 11 + n)), None, list(range(4 * (n + 1)))))
        elif op == "remove":
            _apply(idx, BlockRemoved(block_hashes=[10 + n], medium="GPU"))
        else:
            _apply(idx, AllBlocksCleared())
        # the holders of each block are exactly the replicas whose index counts it.
        expected: dict[int, int] = {}
        for bit, i in enumerate(indexes):
            for key in i._count:
                expected[key] = expected.get(key, 0) | 1 << bit
        assert holders.masks == expected


def test_at_pool_scale_a_prompt_goes_where_the_events_say_its_prefix_is() -> None:
    # Given a pool of 100 replicas whose KV events this gateway follows, one of them (by the
    # events only: another gateway sent the prompt there) holding a long prompt's first blocks,
    clock = ManualClock(10.0)
    fleet = bench_fleet(100)
    registry = ReplicaRegistry.from_fleet(fleet, clock)
    router = build_router(fleet.router, clock=clock, seed=0)
    holders = BlockHolders()
    states = registry.in_pool(rs.POOL)
    for s in states:
        idx = ReplicaBlockIndex()
        idx.reset(complete=True)
        idx.share(holders, holders.bit(s.name))
        idx.synced(10.0)
        s.kv_events = idx
        registry.changed(s)
    prompt = list(range(1, 4 * 64 + 1))
    keys = PromptKeys(lambda: prompt)
    holder = states[57]
    assert holder.kv_events is not None
    _apply(holder.kv_events, _stored(list(range(1000, 1048)), None, prompt[: 4 * 48]))
    # and every replica a little busy but the holder busier than most,
    for i, s in enumerate(states):
        for _ in range(1 + (i == 57)):
            registry.acquire(s, None, 100)
    request = RouteRequest(
        fleet.pools[rs.POOL].model, block_tokens=4, prompt_tokens=len(prompt), engine_keys=keys
    )
    # When the tidal profile routes the prompt (on nominees: the pool is above narrow_above),
    views = registry.views(rs.POOL)
    assert isinstance(views, PoolIndex) and len(views) > router.profiles["tidal"].narrow_above
    result = router.route(request, views)
    # Then the events' holder was nominated and picked, its cached blocks counted exactly,
    assert result is not None and result.replica.name == holder.name, result
    assert result.notes["kv_index"] == "exact" and len(result.scores) < 40


# -- the kv-index's replicas with room --------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    full=st.sets(st.integers(0, 99)),
    busy=st.lists(st.integers(0, 99), max_size=300),
    excluded=st.sets(st.integers(0, 99), max_size=30),
)
def test_the_replica_with_room_is_the_least_loaded_candidate_without_a_tail(
    full: set[int], busy: list[int], excluded: set[int]
) -> None:
    # Given a pool of 100 replicas whose kv-index caches hold 4 blocks (a key per block), some
    # of them full,
    clock = ManualClock(1.0)
    registry = ReplicaRegistry.from_fleet(bench_fleet(100), clock)
    states = registry.in_pool(rs.POOL)
    kv = KVIndex(params=KVParams(max_blocks_per_replica=4, index_tokens=16))
    pool = registry.views(rs.POOL)
    for i in sorted(full):
        request = RouteRequest("m", prefix_blocks=(i, 1000 + i, 2000 + i, 3000 + i, 4000 + i))
        kv.after_pick(request, pool[i], CycleState(request, clock.now(), random.Random(0)))
    # and some load on any of them (requests in flight),
    for i in busy:
        registry.acquire(states[i], None, 100)
    pool = registry.views(rs.POOL)
    names = frozenset(pool.names())
    cands = PoolCandidates(pool, names, frozenset(), exclude=frozenset(states[i].name for i in excluded))
    # Then the one nominated for its room is the least loaded candidate whose cache is not full,
    expected = next(
        (v.name for v in pool.least_loaded() if v.name not in kv._tail_of and v.name in cands), None
    )
    assert kv._least_loaded_with_room(cands) == expected
    # and stays so when one more cache fills.
    spare = next((i for i in range(100) if i not in full), None)
    if spare is not None:
        request = RouteRequest("m", prefix_blocks=tuple(range(10_000, 10_005)))
        kv.after_pick(request, pool[spare], CycleState(request, clock.now(), random.Random(0)))
        expected = next(
            (v.name for v in pool.least_loaded() if v.name not in kv._tail_of and v.name in cands), None
        )
        assert kv._least_loaded_with_room(cands) == expected


@given(st.integers(1, 1 << 3000))
def test_the_bits_of_a_holders_mask_are_listed_lowest_first(held: int) -> None:
    assert _set_bits(held) == [i for i in range(held.bit_length()) if held >> i & 1]


@given(st.lists(st.integers(0, 40), unique=True), st.sets(st.integers(0, 40)), st.sets(st.integers(0, 40)))
def test_among_keeps_the_candidates_in_order(names: list[int], members: set[int], excluded: set[int]) -> None:
    registry = ReplicaRegistry.from_fleet(bench_fleet(41), ManualClock())
    pool = registry.views(rs.POOL)
    every = pool.names()
    cands = PoolCandidates(
        pool,
        frozenset(every[i] for i in members),
        frozenset(every[i] for i in set(range(41)) - members),
        exclude=frozenset(every[i] for i in excluded),
    )
    asked = [every[i] for i in names]
    assert cands.among(asked) == [n for n in asked if n in cands]


# -- a replica that leaves ----------------------------------------------------------------------------


def test_a_replica_that_leaves_is_forgotten_by_every_index() -> None:
    # Given the built-in profiles' indexes after a stream of chat requests on 8 replicas
    # (their caches filled past capacity, so the kv-index keeps tails),
    clock = ManualClock(1.0)
    fleet = bench_fleet(8)
    registry = ReplicaRegistry.from_fleet(fleet, clock)
    router = build_router(fleet.router, clock=clock, seed=0)
    kv = next(p for p in router.profiles["tidal"].producers if isinstance(p, KVIndex))
    kv.params = KVParams(max_blocks_per_replica=250)  # (keys of 32 tokens: 500 chat blocks)
    for request in rs._requests(bench_fleet(1), 240, 0):
        clock.advance(0.01)
        for profile in ("tidal", "llm_d", "sglang_cache_aware"):
            assert router.route(request, registry.views(rs.POOL), profile=profile) is not None
    gone = registry.in_pool(rs.POOL)[3].name
    assert gone in kv._lru and gone in kv._tail_of and gone in kv._holders.bits
    bit = kv._holders.bits[gone]
    # When the replica leaves the pool and the router is told,
    registry.remove(gone)
    router.forget(gone)
    # Then no index keeps anything of it: the kv-index's blocks, bit, tail and sums,
    assert gone not in kv._lru and gone not in kv._tail_of and gone not in kv._sent
    assert gone not in kv._capacity and all(name != gone for _, name in kv._sorted_tails())
    assert gone not in kv._holders.bits and kv._holders.names[bit] is None
    assert all(not mask >> bit & 1 for mask in kv._holders.masks.values())
    for profile in ("llm_d", "sglang_cache_aware"):
        for p in router.profiles[profile].producers:
            assert gone not in getattr(p, "_lru", {}) and gone not in getattr(p, "_trees", {})
    # and the next replica to join takes the freed bit, which no block carries.
    assert kv._holders.bit("newcomer") == bit


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["acquire", "release", "scrape", "read"]), st.integers(0, 5)),
        max_size=60,
    )
)
def test_the_load_order_and_totals_are_those_of_the_current_views(ops: list[tuple[str, int]]) -> None:
    """Counted when read, not when a view is rebuilt: whatever was read in between, the pool's
    load order, totals and full replicas are those of its current views."""
    clock = ManualClock()
    registry = ReplicaRegistry.from_fleet(bench_fleet(6), clock)
    states = registry.in_pool(rs.POOL)
    running = [0] * len(states)

    def check(pool: PoolIndex, which: int) -> None:  # one reading at a time: each counts
        views = list(pool)
        if which % 4 == 0:
            assert list(pool.names_by_load()) == [
                v.name for v in sorted(views, key=lambda v: (v.load, v.prefill_tokens, v.name))
            ]
        elif which % 4 == 1:
            assert pool.load_total == pytest.approx(sum(v.load for v in views))
        elif which % 4 == 2:
            assert pool.prefill_total == sum(v.prefill_tokens for v in views)
        else:
            assert pool.full == {v.name for v in views if v.inflight >= v.cap}

    for op, i in ops:
        s = states[i]
        if op == "acquire":  # in sixes: a replica reaches its cap (16) in three
            for _ in range(6):
                registry.acquire(s, None, 100 * (i + 1))
            running[i] += 6
        elif op == "release" and running[i]:
            for _ in range(6):
                registry.release(s, tpot_s=0.03, pending_prompt_tokens=100 * (i + 1))
            running[i] -= 6
        elif op == "scrape":
            registry.update_snapshot(s.name, LoadSnapshot(num_running=float(i + running[i]), num_waiting=1.0))
        else:
            check(registry.views(rs.POOL), i)
    for which in range(4):
        check(registry.views(rs.POOL), which)
