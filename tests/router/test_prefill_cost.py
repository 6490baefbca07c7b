"""The ``kv-index`` producer and the ``prefill-cost-scorer``: what the default profile routes on."""

from __future__ import annotations

import math
import random

from hypothesis import given, strategies as hst

from tidal.replicas.metrics import LoadSnapshot
from tidal.router.loader import build_router
from tidal.router.lru import run_between
from tidal.router.plugins.producers.kv_index import (
    CACHED_TOKENS,
    TAIL_AGE,
    UNCACHED_SHARE,
    KVIndex,
    leading_run,
)
from tidal.router.plugins.scorers.prefill_cost import PrefillCostScorer
from tidal.router.types import CycleState, ReplicaView, RouteRequest

NAMES = ["a", "b", "c", "d"]


def st(req: RouteRequest, now: float = 0.0) -> CycleState:
    return CycleState(req, now, random.Random(0))


def turn(*blocks: int) -> RouteRequest:
    """A prompt of 512-token blocks, as in the Mooncake trace."""
    return RouteRequest("m", prefix_blocks=blocks, block_tokens=512, prompt_tokens=512 * len(blocks))


def views(**prefill: int) -> list[ReplicaView]:
    return [ReplicaView(n, model="m", prefill_tokens=prefill.get(n, 0)) for n in NAMES]


def test_leading_run_is_the_held_prefix_of_the_chain() -> None:
    held = {1: 0.0, 2: 0.0, 3: 0.0, 9: 0.0}
    assert leading_run(held, (1, 2, 3, 4, 5)) == 3
    assert leading_run(held, (1, 2, 3)) == 3
    assert leading_run(held, (7, 8)) == 0
    assert leading_run(held, ()) == 0


@given(hst.integers(1, 300), hst.data())
def test_leading_run_finds_where_a_held_prefix_ends(n: int, data: hst.DataObject) -> None:
    blocks = tuple(range(1000, 1000 + n))
    run = data.draw(hst.integers(0, n))
    held = dict.fromkeys(blocks[:run], 0.0) | dict.fromkeys(range(run), 0.0)  # and other chains' blocks
    assert leading_run(held, blocks) == run == leading_run(held, blocks, blocks[::-1])


@given(hst.integers(2, 300), hst.data())
def test_run_between_finds_the_run_whatever_it_is_guessed(n: int, data: hst.DataObject) -> None:
    """The guesses other replicas' runs give only save probes: right, wrong or out of range,
    the run found is the held prefix, and a run that had to be searched for joins them."""
    blocks = tuple(range(1000, 1000 + n))
    run = data.draw(hst.integers(1, n - 1))  # (0 and n are answered before run_between)
    guesses = data.draw(hst.lists(hst.integers(-2, n + 2), max_size=3))
    probes: list[int] = []

    def held(key: int) -> bool:
        probes.append(key)
        return key < 1000 + run

    before = list(guesses)
    assert run_between(held, blocks, blocks[::-1], guesses) == run
    if run in before:
        assert len(probes) <= 2 * len(before)
    elif len(before) < 3:
        assert guesses == [*before, run]


def test_index_counts_cached_tokens_and_forgets_a_chain_tail_first() -> None:
    idx = KVIndex()
    vs = views()
    idx.after_pick(turn(1, 2, 3), vs[0], st(turn(1, 2, 3)))
    s = st(turn(1, 2, 3, 4))
    idx.produce(turn(1, 2, 3, 4), vs, vs, s)
    assert s.get(CACHED_TOKENS) == {"a": 3 * 512, "b": 0, "c": 0, "d": 0}
    # A replica whose KV holds 4 blocks of 512 tokens (128 blocks of 16) keeps the *heads* of
    # two chains: a new prompt evicts the least recently used tail, not the shared start.
    small = ReplicaView("s", model="m", snapshot=LoadSnapshot(num_gpu_blocks=128, block_size=16))
    idx.after_pick(turn(1, 2, 3), small, st(turn(1, 2, 3), now=1.0))
    idx.after_pick(turn(1, 5, 6), small, st(turn(1, 5, 6), now=2.0))
    s = st(turn(1, 2, 3), now=3.0)
    idx.produce(turn(1, 2, 3), [small], [small], s)
    assert s.get(CACHED_TOKENS) == {"s": 2 * 512}  # block 3 went, 1 and 2 stayed
    assert s.get(TAIL_AGE) == {"s": 2.0}  # full: its oldest block (2) was last used at t=1


def chat(*blocks: int) -> RouteRequest:
    """A prompt of 16-token blocks, as the gateway hashes chat text."""
    return RouteRequest("m", prefix_blocks=blocks, block_tokens=16, prompt_tokens=16 * len(blocks))


def test_chat_blocks_are_kept_one_key_per_32_tokens() -> None:
    # Given a replica sent a prompt of 15 chat blocks (240 tokens): keys at blocks 2, 4, ... 14,
    idx = KVIndex()
    vs = views()
    sent = chat(*range(1, 16))
    idx.after_pick(sent, vs[0], st(sent))
    assert len(idx._lru["a"]) == 7
    # a follow-up sharing its first 9 blocks counts the whole 32-token steps inside them (8
    # blocks), a repeat the 14 blocks its keys cover, and a prompt under 32 tokens nothing.
    for prompt, tokens in ((chat(*range(1, 10), 99, 98, 97), 8 * 16), (sent, 14 * 16), (chat(1), 0)):
        s = st(prompt)
        idx.produce(prompt, vs, vs, s)
        assert s.get(CACHED_TOKENS) == {"a": tokens, "b": 0, "c": 0, "d": 0}
    # A replica's KV size is counted in keys: 128 blocks of 16 tokens hold 64.
    small = ReplicaView("s", model="m", snapshot=LoadSnapshot(num_gpu_blocks=128, block_size=16))
    for k in range(3):
        long = chat(*range(1000 * (k + 1), 1000 * (k + 1) + 64))  # 32 keys each
        idx.after_pick(long, small, st(long, now=1.0 + k))
    assert len(idx._lru["s"]) == 64


def test_tail_age_is_infinite_while_the_cache_has_room() -> None:
    idx = KVIndex()
    s = st(turn(1))
    idx.produce(turn(1), views(), views(), s)
    ages = s.get(TAIL_AGE)
    assert ages is not None and all(math.isinf(a) for a in ages.values())


def test_a_scrape_that_moves_the_kv_size_moves_the_tail_age_at_once() -> None:
    # Given a replica with room for 8 blocks of 512 tokens, holding 3,
    idx = KVIndex()
    roomy = ReplicaView("s", model="m", snapshot=LoadSnapshot(num_gpu_blocks=256, block_size=16))
    idx.after_pick(turn(1, 2, 3), roomy, st(turn(1, 2, 3), now=1.0))
    s = st(turn(1), now=5.0)
    idx.produce(turn(1), [roomy], [roomy], s)
    assert s.get(TAIL_AGE) == {"s": math.inf}
    # when a scrape says its cache now holds 3 (a restart with less memory), its cache is full:
    # the next decision sees its tail's age before any new pick there,
    full = ReplicaView("s", model="m", snapshot=LoadSnapshot(num_gpu_blocks=96, block_size=16))
    s = st(turn(1), now=5.0)
    idx.produce(turn(1), [full], [full], s)
    assert s.get(TAIL_AGE) == {"s": 4.0}
    # and room again, once a scrape says so.
    s = st(turn(1), now=6.0)
    idx.produce(turn(1), [roomy], [roomy], s)
    assert s.get(TAIL_AGE) == {"s": math.inf}


def test_uncached_share_tracks_what_recent_picks_had_to_prefill() -> None:
    idx = KVIndex.from_config("kv", {"share_window": 1})
    vs = views()
    first = turn(1, 2, 3, 4)
    s = st(first)
    idx.produce(first, vs, vs, s)
    idx.after_pick(first, vs[0], s)
    again = turn(1, 2, 3, 4)
    s = st(again)
    idx.produce(again, vs, vs, s)
    idx.after_pick(again, vs[0], s)  # all of it cached on a
    s = st(again)
    idx.produce(again, vs, vs, s)
    share = s.get(UNCACHED_SHARE)
    assert share is not None and share["a"] == 0.0 and share["b"] == 1.0


def score(idx: KVIndex, scorer: PrefillCostScorer, req: RouteRequest, vs: list[ReplicaView]) -> str:
    s = st(req)
    idx.produce(req, vs, vs, s)
    scores = scorer.score(req, vs, s)
    best = max(scores, key=lambda n: scores[n])
    idx.after_pick(req, next(v for v in vs if v.name == best), s)
    return best


def test_a_later_turn_follows_its_prefix_until_the_queue_there_outweighs_it() -> None:
    idx, scorer = KVIndex(), PrefillCostScorer()
    # Turn 1 (8 blocks) finds b idle and the others busy: it goes to b.
    assert score(idx, scorer, turn(*range(1, 9)), views(a=9000, c=9000, d=9000)) == "b"
    # Turn 2 repeats turn 1 and adds 2 blocks; b now has 3000 tokens queued, the others none:
    # b saves 8 x 512 = 4096 tokens of prefill (x 6 for the turns to come), so it stays.
    assert score(idx, scorer, turn(*range(1, 11)), views(b=3000)) == "b"
    # Turn 3 finds 60,000 tokens queued on b: waiting there costs more than the cache saves.
    assert score(idx, scorer, turn(*range(1, 13)), views(b=60_000)) != "b"


def test_a_cold_prompt_goes_where_the_least_prefill_waits() -> None:
    idx, scorer = KVIndex(), PrefillCostScorer()
    assert score(idx, scorer, turn(100, 101), views(a=500, b=100, c=900, d=300)) == "b"


def test_a_cold_prompt_evicts_on_the_replica_whose_cache_is_stalest() -> None:
    # Two replicas, both with full caches of 4 blocks; a's tail was used long ago, b's just now.
    idx, scorer = KVIndex(), PrefillCostScorer()
    full = LoadSnapshot(num_gpu_blocks=128, block_size=16, num_running=0.0)
    a = ReplicaView("a", model="m", snapshot=full, snapshot_at=0.0)
    b = ReplicaView("b", model="m", snapshot=full, snapshot_at=0.0)
    idx.after_pick(turn(1, 2, 3, 4), a, st(turn(1, 2, 3, 4), now=0.0))
    idx.after_pick(turn(5, 6, 7, 8), b, st(turn(5, 6, 7, 8), now=90.0))
    new = turn(20, 21, 22)
    s = st(new, now=100.0)
    idx.produce(new, [a, b], [a, b], s)
    assert s.get(TAIL_AGE) == {"a": 100.0, "b": 10.0}
    scores = scorer.score(new, [a, b], s)
    assert scores["a"] > scores["b"]


def test_the_default_profile_keeps_a_conversation_on_one_replica() -> None:
    # 16 conversations on one shared system block take 4 turns each; a turn's prompt counts as
    # queued prefill on its replica until the round of turns is over.
    router = build_router(None, seed=3)
    placed: dict[int, set[str]] = {}
    history: dict[int, list[int]] = {c: [0, 1000 + c] for c in range(16)}
    for step in range(4):
        queued = dict.fromkeys((f"r{i}" for i in range(8)), 0)
        for conv in range(16):
            history[conv].append(10_000 + conv * 10 + step)
            vs = [ReplicaView(n, model="m", prefill_tokens=q) for n, q in queued.items()]
            result = router.route(turn(*history[conv]), vs)
            assert result is not None
            placed.setdefault(conv, set()).add(result.replica.name)
            queued[result.replica.name] += 512 * len(history[conv])
    # Every conversation stayed where its history is, and the conversations are spread out.
    assert all(len(p) == 1 for p in placed.values())
    assert len({next(iter(p)) for p in placed.values()}) >= 6
