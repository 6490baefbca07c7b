"""Each plugin as a table: given replica views (and produced facts), what it keeps, scores or picks."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from tidal.clock import ManualClock
from tidal.replicas.metrics import LoadSnapshot
from tidal.router.plugins.filters.adapter import AdapterFilter
from tidal.router.plugins.filters.canary import CanaryFilter
from tidal.router.plugins.filters.capacity import CapacityFilter
from tidal.router.plugins.filters.healthy import HealthyFilter
from tidal.router.plugins.filters.model import ModelFilter
from tidal.router.plugins.filters.region import RegionFilter
from tidal.router.plugins.pickers.max_score import MaxScorePicker
from tidal.router.plugins.pickers.power_of_two import PowerOfTwoPicker
from tidal.router.plugins.pickers.round_robin import RoundRobinPicker
from tidal.router.plugins.producers.block_index import TREE_FACTS, ApproxPrefixIndex, RadixTree, TreeFacts
from tidal.router.plugins.producers.rings import PREFIX_CHOICE, PrefixRing, SessionRing
from tidal.router.plugins.scorers.cache_aware import CacheAwareScorer
from tidal.router.plugins.scorers.kv_cache import KVCacheUtilizationScorer
from tidal.router.plugins.scorers.least_inflight import LeastInflightScorer
from tidal.router.plugins.scorers.load import LoadScorer
from tidal.router.plugins.scorers.lora_affinity import LoraAffinityScorer
from tidal.router.plugins.scorers.prefix_affinity import PrefixAffinityScorer
from tidal.router.plugins.scorers.queue import QueueScorer
from tidal.router.ring import BoundedChoice
from tidal.router.types import CycleState, ReplicaView, RouteRequest

NOW = 1000.0


def v(name: str, **kw: Any) -> ReplicaView:
    kw.setdefault("model", "m")
    if "waiting" in kw or "kv" in kw or "running" in kw:
        kw["snapshot"] = LoadSnapshot(
            num_waiting=kw.pop("waiting", 0.0),
            kv_cache_usage=kw.pop("kv", 0.0),
            num_running=kw.pop("running", 0.0),
        )
        age = kw.pop("snapshot_age_s", 0.5)
        kw["snapshot_at"] = NOW - age
        kw["clock"] = ManualClock(NOW)
    return ReplicaView(name, **kw)


def state(req: RouteRequest | None = None, seed: int = 0, now: float = 0.0) -> CycleState:
    return CycleState(req or RouteRequest("m"), now, random.Random(seed))


REQ = RouteRequest("m")
LORA = RouteRequest("m", adapter="support-v2")
EU = RouteRequest("m", regions=frozenset({"eu-west", "eu-central"}))

# -- filters -------------------------------------------------------------------------------------

FILTER_CASES = [
    (
        "healthy drops unhealthy and draining",
        HealthyFilter(),
        REQ,
        [v("a"), v("b", healthy=False), v("c", draining=True)],
        ["a"],
    ),
    (
        "healthy may drop stale snapshots",
        HealthyFilter.from_config("h", {"max_snapshot_age_s": 5}),
        REQ,
        [v("a", waiting=0), v("b")],
        ["a"],
    ),
    (
        "model keeps the request's model and unknowns",
        ModelFilter(),
        REQ,
        [v("a"), v("b", model="other"), v("c", model="")],
        ["a", "c"],
    ),
    ("adapter passes requests without one", AdapterFilter(), REQ, [v("a"), v("b")], ["a", "b"]),
    (
        "adapter keeps holders and loadable replicas",
        AdapterFilter(),
        LORA,
        [v("a", loaded_adapters=frozenset({"support-v2"})), v("b", max_loras=2), v("c")],
        ["a", "b"],
    ),
    ("canary drops weight 0", CanaryFilter(), REQ, [v("a"), v("b", weight=0.0)], ["a"]),
    (
        "capacity drops replicas at their cap",
        CapacityFilter(),
        REQ,
        [v("a", inflight=4, cap=4), v("b", inflight=3, cap=4)],
        ["b"],
    ),
    (
        "capacity keeps all when every one is full",
        CapacityFilter(),
        REQ,
        [v("a", inflight=4, cap=4), v("b", inflight=5, cap=4)],
        ["a", "b"],
    ),
    (
        "region passes requests without regions",
        RegionFilter(),
        REQ,
        [v("a", region="eu-west"), v("b", region="us-east"), v("c")],
        ["a", "b", "c"],
    ),
    (
        "region keeps replicas inside the request's regions, never one of no region",
        RegionFilter(),
        EU,
        [v("a", region="eu-west"), v("b", region="us-east"), v("c"), v("d", region="eu-central")],
        ["a", "d"],
    ),
    (
        "region keeps nothing when no replica is inside",
        RegionFilter(),
        EU,
        [v("b", region="us-east"), v("c")],
        [],
    ),
]


@pytest.mark.parametrize(
    ("case", "plugin", "req", "views", "kept"), FILTER_CASES, ids=[c[0] for c in FILTER_CASES]
)
def test_filters(
    case: str, plugin: Any, req: RouteRequest, views: list[ReplicaView], kept: list[str]
) -> None:
    assert [r.name for r in plugin.filter(req, views, state(req))] == kept


def test_canary_split_follows_the_weights() -> None:
    # Given ten stable replicas at weight 1 and one canary at 0.5, When 20000 requests pass,
    # Then about 0.5 / 10.5 of them see only the canary group.
    views = [v(f"s{i}") for i in range(10)] + [v("c0", group="canary", weight=0.5)]
    f, st = CanaryFilter(), state(seed=3)
    groups = Counter(f.filter(REQ, views, st)[0].group for _ in range(20000))
    assert groups["canary"] / 20000 == pytest.approx(0.5 / 10.5, abs=0.01)


# -- scorers -------------------------------------------------------------------------------------

SCORER_CASES = [
    (
        "load blends in-flight, waiting and KV",
        LoadScorer(),
        REQ,
        [v("a", inflight=0, cap=10), v("b", inflight=5, cap=10, waiting=2, kv=0.5)],
        {"a": 1.0, "b": 1 - 1.2 / 3},
    ),
    (
        "load counts scraped running + waiting above in-flight",
        LoadScorer(),
        REQ,
        [v("a", inflight=1, cap=10, running=9, waiting=1)],
        {"a": 1 - 1.1 / 3},
    ),
    (
        "load ignores stale snapshots",
        LoadScorer(),
        REQ,
        [v("a", inflight=5, cap=10, waiting=10, kv=1.0, snapshot_age_s=60)],
        {"a": 1 - 0.5 / 3},
    ),
    (
        "least-inflight min-max",
        LeastInflightScorer(),
        REQ,
        [v("a", inflight=2), v("b", inflight=6), v("c", inflight=4)],
        {"a": 1.0, "b": 0.0, "c": 0.5},
    ),
    ("least-inflight all equal", LeastInflightScorer(), REQ, [v("a"), v("b")], {"a": 1.0, "b": 1.0}),
    (
        "queue min-max on scraped waiting",
        QueueScorer(),
        REQ,
        [v("a", waiting=0), v("b", waiting=8)],
        {"a": 1.0, "b": 0.0},
    ),
    ("kv is 1 - usage", KVCacheUtilizationScorer(), REQ, [v("a", kv=0.25), v("b")], {"a": 0.75, "b": 1.0}),
    (
        "lora: holder in bound 1, free slot 0.3, full 0.1",
        LoraAffinityScorer(),
        LORA,
        [
            v("a", loaded_adapters=frozenset({"support-v2"}), max_loras=2),
            v("b", max_loras=2),
            v("c", loaded_adapters=frozenset({"x", "y"}), max_loras=2),
        ],
        {"a": 1.0, "b": 0.3, "c": 0.1},
    ),
    (
        "lora: an overloaded holder loses to a free slot",
        LoraAffinityScorer(),
        LORA,
        [v("a", loaded_adapters=frozenset({"support-v2"}), max_loras=2, inflight=20), v("b", max_loras=2)],
        {"a": 0.2, "b": 0.3},
    ),
    ("lora: no adapter, no scores", LoraAffinityScorer(), REQ, [v("a")], {}),
]


@pytest.mark.parametrize(
    ("case", "plugin", "req", "views", "want"), SCORER_CASES, ids=[c[0] for c in SCORER_CASES]
)
def test_scorers(
    case: str, plugin: Any, req: RouteRequest, views: list[ReplicaView], want: dict[str, float]
) -> None:
    got = plugin.score(req, views, state(req))
    assert got == pytest.approx(want)
    assert all(0.0 <= s <= 1.0 for s in got.values())


def test_prefix_affinity_reads_the_ring_choice() -> None:
    st = state()
    assert PrefixAffinityScorer().score(REQ, [v("a"), v("b")], st) == {}
    st.put(PREFIX_CHOICE, BoundedChoice("b", "a", 1))
    assert PrefixAffinityScorer().score(REQ, [v("a"), v("b")], st) == {"b": 1.0}


CACHE_AWARE_CASES = [
    # (in-flight loads, tree match, tree sizes) -> replicas scored 1
    ("imbalanced: shortest queue", {"a": 100, "b": 10}, {"a": 1.0, "b": 0.0}, {"a": 5, "b": 5}, {"b"}),
    ("abs gap alone is not imbalance", {"a": 100, "b": 90}, {"a": 1.0, "b": 0.0}, {"a": 5, "b": 5}, {"a"}),
    ("best match above threshold", {"a": 0, "b": 0}, {"a": 0.2, "b": 0.6}, {"a": 5, "b": 50}, {"b"}),
    ("low match: smallest tree", {"a": 0, "b": 0}, {"a": 0.2, "b": 0.1}, {"a": 5, "b": 50}, {"a"}),
]


@pytest.mark.parametrize(
    ("case", "loads", "match", "size", "winners"), CACHE_AWARE_CASES, ids=[c[0] for c in CACHE_AWARE_CASES]
)
def test_cache_aware(
    case: str, loads: dict[str, int], match: dict[str, float], size: dict[str, int], winners: set[str]
) -> None:
    st = state()
    st.put(TREE_FACTS, TreeFacts(match, size))
    scores = CacheAwareScorer().score(REQ, [v(n, inflight=x) for n, x in loads.items()], st)
    assert {n for n, s in scores.items() if s == 1.0} == winners


# -- pickers -------------------------------------------------------------------------------------


def test_max_score_breaks_ties_with_the_seeded_rng() -> None:
    scored = [(v("a"), 1.0), (v("b"), 2.0), (v("c"), 2.0)]
    picks = Counter(MaxScorePicker().pick(scored, state(seed=s)).name for s in range(200))
    assert set(picks) == {"b", "c"} and min(picks.values()) > 60
    assert (
        MaxScorePicker().pick(scored, state(seed=1)).name == MaxScorePicker().pick(scored, state(seed=1)).name
    )


def test_round_robin_cycles_and_power_of_two_prefers_the_better() -> None:
    rr = RoundRobinPicker()
    scored = [(v(n), 0.0) for n in "abc"]
    assert [rr.pick(scored, state()).name for _ in range(6)] == list("abcabc")
    p2 = PowerOfTwoPicker()
    scored2 = [(v("a"), 1.0), (v("b"), 0.0)]
    assert {p2.pick(scored2, state(seed=s)).name for s in range(20)} == {"a"}


# -- producers -----------------------------------------------------------------------------------


def test_prefix_ring_notes_hits_and_walks() -> None:
    ring = PrefixRing("prefix-ring")
    req = RouteRequest("m", prefix_key=123)
    views = [v("a"), v("b"), v("c")]
    st = state(req)
    ring.produce(req, views, views, st)
    choice = st.get(PREFIX_CHOICE)
    assert choice is not None
    ring.after_pick(req, next(x for x in views if x.name == choice.target), st)
    assert st.notes["prefix"] == "hit"
    # The home replica is now far over the bound: the key walks.
    busy = [v(x.name, inflight=50 if x.name == choice.home else 0) for x in views]
    st2 = state(req)
    ring.produce(req, busy, busy, st2)
    c2 = st2.get(PREFIX_CHOICE)
    assert c2 is not None and c2.target != c2.home and c2.walks == 1
    ring.after_pick(req, next(x for x in busy if x.name == c2.target), st2)
    assert st2.notes == {"prefix": "walked", "ring_walks": 1}


def test_session_ring_without_a_session_notes_none() -> None:
    ring = SessionRing("session-ring")
    st = state()
    ring.produce(REQ, [v("a")], [v("a")], st)
    ring.after_pick(REQ, v("a"), st)
    assert st.notes["session"] == "none"


def test_approx_index_matches_leading_blocks_and_is_sized_by_the_kv_cache() -> None:
    idx = ApproxPrefixIndex()
    first = RouteRequest("m", prefix_blocks=(1, 2, 3, 4))
    idx.after_pick(first, v("a"), state())
    st = state()
    idx.produce(RouteRequest("m", prefix_blocks=(1, 2, 9, 9)), [v("a"), v("b")], [v("a"), v("b")], st)
    from tidal.router.plugins.producers.block_index import INDEX_MATCH

    assert st.get(INDEX_MATCH) == {"a": 0.5, "b": 0.0}
    # A replica with 2 KV blocks of 16 tokens holds two 16-token prompt blocks: LRU keeps the last two.
    small = ReplicaView("s", snapshot=LoadSnapshot(num_gpu_blocks=2, block_size=16))
    idx.after_pick(first, small, state())
    st = state()
    idx.produce(RouteRequest("m", prefix_blocks=(1, 2, 3, 4)), [small], [small], st)
    assert st.get(INDEX_MATCH) == {"s": 0.0}  # block 1 was evicted, so nothing leads


def test_radix_tree_evicts_least_recent_beyond_its_size() -> None:
    tree = RadixTree.from_config("t", {"max_tree_blocks": 3, "eviction_interval_s": 10})
    tree.after_pick(RouteRequest("m", prefix_blocks=(1, 2)), v("a"), state(now=0))
    tree.after_pick(RouteRequest("m", prefix_blocks=(3, 4)), v("a"), state(now=5))
    st = state()
    tree.produce(RouteRequest("m", prefix_blocks=(1, 2)), [v("a")], [v("a")], st)
    facts = st.get(TREE_FACTS)
    assert facts is not None and facts.size == {"a": 4} and facts.match == {"a": 1.0}
    tree.after_pick(RouteRequest("m", prefix_blocks=(5,)), v("a"), state(now=11))  # eviction round
    st = state()
    tree.produce(RouteRequest("m", prefix_blocks=(1, 2)), [v("a")], [v("a")], st)
    facts = st.get(TREE_FACTS)
    assert facts is not None and facts.size == {"a": 3} and facts.match == {"a": 0.0}


def test_prefix_ring_follows_a_key_to_where_its_prefix_went() -> None:
    # Given a conversation whose ring replica was busy with queued prefill when its first turn came,
    ring = PrefixRing("prefix-ring")
    names = ["a", "b", "c", "d"]
    first = RouteRequest("m", prefix_key=77, prompt_tokens=4000)
    probe = state(first)
    idle = [v(n) for n in names]
    ring.produce(first, idle, idle, probe)
    home = probe.get(PREFIX_CHOICE).home  # type: ignore[union-attr]
    busy = [v(n, prefill_tokens=60_000 if n == home else 0) for n in names]
    st = state(first, now=1.0)
    ring.produce(first, busy, busy, st)
    walked = st.get(PREFIX_CHOICE)
    assert walked is not None and walked.target != home
    ring.after_pick(first, next(x for x in busy if x.name == walked.target), st)
    # When its second turn (which repeats the first) arrives and the ring replica is idle again,
    second = RouteRequest("m", prefix_key=77, prompt_tokens=5000)
    st2 = state(second, now=2.0)
    ring.produce(second, idle, idle, st2)
    # Then it follows its prefix to where it went, not back to its ring replica.
    followed = st2.get(PREFIX_CHOICE)
    assert followed is not None and followed.target == walked.target
    ring.after_pick(second, next(x for x in idle if x.name == walked.target), st2)
    assert st2.notes["prefix"] == "followed"
