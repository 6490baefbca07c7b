"""The exact KV index: events in, blocks out, and the ``kv-index`` producer's use of it.

Tiny exact configs: 4-token blocks, token ids written out, block hashes as small ints.
"""

from __future__ import annotations

import random

import pytest

from tidal.clock import ManualClock
from tidal.replicas.sim.tokenizer import WordTokenizer
from tidal.replicas.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tidal.router import kv_events
from tidal.router.kv_events import (
    BlockHolders,
    PromptKeys,
    PromptTokenizer,
    ReplicaBlockIndex,
    chain_keys,
    chat_prompt_keys,
    completion_prompt_keys,
)
from tidal.router.loader import build_router
from tidal.router.plugins.producers.kv_index import CACHED_TOKENS, KVIndex
from tidal.router.types import CycleState, ReplicaView, RouteRequest

BS = 4
PROMPT = list(range(1, 17))  # four blocks of 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    fields: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None, "block_size": BS}
    fields.update(kw)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, **fields)  # type: ignore[arg-type]


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, list(events), 0)  # type: ignore[arg-type]


def index(*events: object) -> ReplicaBlockIndex:
    idx = ReplicaBlockIndex()
    idx.reset(complete=True)
    idx.apply(batch(*events))
    return idx


def keys(tokens: list[int] = PROMPT, **kw: object) -> tuple[int, ...]:
    return chain_keys(tokens, BS, **kw)  # type: ignore[arg-type]


# -- the index -------------------------------------------------------------------------------------


def test_the_prompts_keys_match_what_the_events_stored() -> None:
    idx = index(stored([11, 12], None, PROMPT[:8]), stored([13], 12, PROMPT[8:12]))
    assert idx.block_size == BS and len(idx) == 3
    assert idx.leading(keys()) == 3
    assert idx.leading(keys([1, 2, 3, 4, 9, 9, 9, 9])) == 1  # shares the first block only
    assert idx.leading(keys([0, *PROMPT])) == 0  # shifted by one token: nothing


@pytest.mark.parametrize(
    ("events", "leading", "size"),
    [
        # a removal takes a block out; the engine's lookup stops at the first miss
        ([stored([11, 12, 13], None, PROMPT[:12]), BlockRemoved(block_hashes=[12], medium="GPU")], 1, 2),
        # removals of blocks never seen (stored before we joined) are ignored
        ([stored([11], None, PROMPT[:4]), BlockRemoved(block_hashes=[99], medium="GPU")], 1, 1),
        # a cleared cache holds nothing
        ([stored([11, 12], None, PROMPT[:8]), AllBlocksCleared()], 0, 0),
        # a child whose parent we never saw cannot be keyed: it does not count
        ([stored([12], 11, PROMPT[4:8])], 0, 0),
        # other media (a CPU offload tier) and other KV cache groups are not the GPU prefix cache
        ([stored([11], None, PROMPT[:4], medium="CPU")], 0, 0),
        ([stored([11], None, PROMPT[:4], group_idx=1)], 0, 0),
        # token ids that do not fill the blocks: not comparable with prompts
        ([stored([11, 12], None, PROMPT[:6])], 0, 0),
        # hashes as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) link parents the same way
        ([stored([b"\x00" * 31 + b"\x0b"], None, PROMPT[:4]), stored([12], 11, PROMPT[4:8])], 2, 2),
    ],
)
def test_events_table(events: list[object], leading: int, size: int) -> None:
    idx = index(*events)
    assert (idx.leading(keys()), len(idx)) == (leading, size)


def test_duplicate_copies_are_counted_and_removed_one_by_one() -> None:
    # Two requests computed the same block at once: vLLM stores it twice and removes each copy.
    idx = index(stored([11], None, PROMPT[:4]), stored([11], None, PROMPT[:4]))
    idx.apply(batch(BlockRemoved(block_hashes=[11], medium="GPU")))
    assert idx.leading(keys()) == 1
    idx.apply(batch(BlockRemoved(block_hashes=[11], medium="GPU")))
    assert idx.leading(keys()) == 0 and len(idx) == 0


def test_lora_blocks_match_only_prompts_of_that_adapter() -> None:
    idx = index(stored([21, 22], None, PROMPT[:8], lora_id=1, lora_name="ad", extra_keys=[("ad",), ("ad",)]))
    assert idx.leading(keys()) == 0
    assert idx.leading(keys(extra=("ad",))) == 2
    assert idx.leading(keys(extra=("other",))) == 0
    # Without extra_keys (older vLLM) the adapter's name is taken from lora_name.
    old = index(stored([21], None, PROMPT[:4], lora_id=1, lora_name="ad"))
    assert old.leading(keys(extra=("ad",))) == 1


def test_cache_salt_goes_into_the_first_block_only() -> None:
    idx = index(stored([31, 32], None, PROMPT[:8], extra_keys=[("s1",), None]))
    assert idx.leading(keys(salt="s1")) == 2
    assert idx.leading(keys()) == 0


def test_memory_is_bounded_and_the_picture_then_incomplete() -> None:
    idx = ReplicaBlockIndex(max_blocks=2)
    idx.reset(complete=True)
    idx.apply(batch(stored([11, 12, 13], None, PROMPT[:12])))
    assert len(idx) == 2 and not idx.complete
    assert idx.leading(keys()) == 0  # the oldest (the chain's head) went first


def test_the_pools_holders_match_every_replica_as_its_own_index_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass over the prompt through the shared holders gives each replica the run its own
    index gives, whatever the events did: removals in the middle of a chain (a cache that is not
    prefix-closed), copies, clears, the memory bound, a replica leaving."""
    monkeypatch.setattr(kv_events, "_SCAN_BLOCKS", 0)  # (short prompts are walked otherwise)
    rng = random.Random(5)
    holders = BlockHolders()
    names = [f"r{i}" for i in range(6)]
    idxs = {}
    for n in names:
        idxs[n] = ReplicaBlockIndex(max_blocks=40)
        idxs[n].reset(complete=True)
        idxs[n].share(holders, holders.bit(n))
    prompts = [[rng.randrange(3) for _ in range(BS * rng.randint(1, 8))] for _ in range(12)]
    next_hash = iter(range(1, 1 << 30))
    hashes: dict[str, list[int]] = {n: [] for n in names}
    for _ in range(400):
        name = rng.choice(names)
        idx, roll = idxs[name], rng.random()
        if roll < 0.6:
            tokens = rng.choice(prompts)
            hs = [next(next_hash) for _ in range(len(tokens) // BS)]
            idx.apply(batch(stored(hs, None, tokens)))
            hashes[name] += hs
        elif roll < 0.9 and hashes[name]:
            idx.apply(batch(BlockRemoved(block_hashes=[rng.choice(hashes[name])], medium="GPU")))
        elif roll < 0.95:
            idx.apply(batch(AllBlocksCleared()))
        else:  # the replica leaves and a new one takes its bit
            idx.unshare()
            holders.release(name)
            idxs[name] = ReplicaBlockIndex(max_blocks=40)
            idxs[name].reset(complete=True)
            idxs[name].share(holders, holders.bit(name))
            hashes[name] = []
        memo: dict = {}
        for tokens in rng.sample(prompts, 3):
            k = keys(tokens)
            assert [i.leading_shared(k, memo) for i in idxs.values()] == [i.leading(k) for i in idxs.values()]
    assert any(i.leading(keys(p)) for i in idxs.values() for p in prompts)  # (it matched something)


def test_freshness_is_the_age_of_the_last_proof() -> None:
    idx = ReplicaBlockIndex()
    assert not idx.fresh(0.0, 2.0)  # never proven
    idx.synced(10.0)
    assert idx.fresh(12.0, 2.0) and not idx.fresh(12.1, 2.0)


# -- the gateway's keys ------------------------------------------------------------------------------


def test_prompt_keys_are_computed_once_per_block_size_and_stop_before_the_last_token() -> None:
    calls = []

    def tokens() -> list[int]:
        calls.append(1)
        return PROMPT

    pk = PromptKeys(tokens)
    assert pk(BS) == keys()[:3]  # 16 tokens: the engine recomputes the last, so 3 blocks can hit
    assert pk(BS) == keys()[:3] and pk(8) == chain_keys(PROMPT, 8)[:1]
    assert len(calls) == 1


def test_chat_keys_render_the_template_like_the_simulator() -> None:
    tok = WordTokenizer()
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    gateway = PromptTokenizer(tok)
    pk = chat_prompt_keys(gateway, msgs, adapter="ad")
    assert pk is not None
    ids = tok.encode(
        tok.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    )
    assert list(pk.token_ids) == ids
    assert pk(2) == chain_keys(ids, 2, extra=("ad",), limit=(len(ids) - 1) // 2)
    assert chat_prompt_keys(gateway, [{"role": "user", "content": [{"type": "image_url"}]}]) is None
    assert completion_prompt_keys(gateway, ["a", "b"]) is None
    ids_prompt = completion_prompt_keys(gateway, [5, 6, 7])
    assert ids_prompt is not None and list(ids_prompt.token_ids) == [5, 6, 7]


CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer in French. " * 30},
        {"role": "user", "content": "Bonjour  !\n"},
    ],
    [
        {"role": "system", "content": "You answer in French. " * 30},
        {"role": "user", "content": "Bonjour  !\n"},
        {"role": "assistant", "content": " Salut, 123 caf\u00e9\t"},
        {"role": "user", "content": "<|im_start|> is not special inside text? 4417."},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("which", ["sim", "hf"])
def test_the_gateways_segment_cache_tokenises_exactly_like_the_replica(
    which: str, request: pytest.FixtureRequest
) -> None:
    from tidal.replicas.sim.tokenizer import HFTokenizer

    tok = (
        WordTokenizer()
        if which == "sim"
        else HFTokenizer(request.getfixturevalue("tiny_model_root") / "model")
    )
    gateway = PromptTokenizer(tok)
    assert gateway.chat.segmenting
    for _ in range(2):  # cold, then from cached pieces
        for msgs in CONVERSATIONS:
            assert gateway.chat_ids(msgs) == tok.encode(tok.render_chat(msgs))
    assert gateway.chat.hits > 0


# -- the producer ------------------------------------------------------------------------------------


def view(name: str, idx: ReplicaBlockIndex | None) -> ReplicaView:
    return ReplicaView(name, model="m", kv_events=idx)


def request(tokens: list[int] = PROMPT, blocks: tuple[int, ...] = ()) -> RouteRequest:
    return RouteRequest(
        "m",
        prefix_blocks=blocks,
        block_tokens=BS,
        prompt_tokens=len(tokens),
        engine_keys=PromptKeys(lambda: tokens),
    )


def per_block() -> KVIndex:
    """A kv-index whose estimate keeps every block (these prompts are a few 4-token blocks)."""
    return KVIndex.from_config("kv-index", {"index_tokens": BS})


def cached(
    producer: KVIndex, req: RouteRequest, vs: list[ReplicaView], now: float
) -> tuple[dict[str, int], str]:
    s = CycleState(req, now, random.Random(0))
    producer.produce(req, vs, vs, s)
    got = s.get(CACHED_TOKENS)
    assert got is not None
    return got, s.notes["kv_index"]


def test_a_fresh_index_is_used_and_a_stale_one_never() -> None:
    idx = index(stored([11, 12], None, PROMPT[:8]))
    idx.synced(100.0)
    producer = KVIndex()  # max_staleness_s 2
    vs = [view("a", idx), view("b", None)]
    assert cached(producer, request(), vs, now=101.0) == ({"a": 8, "b": 0}, "mixed")
    assert cached(producer, request(), vs, now=102.0) == ({"a": 8, "b": 0}, "mixed")
    # Older than the bound: the estimate (which never saw this prompt) decides, not the index.
    assert cached(producer, request(), vs, now=102.01) == ({"a": 0, "b": 0}, "estimate")


def test_the_estimate_still_covers_a_fresh_index_for_what_was_just_sent_there() -> None:
    idx = index()  # knows the replica holds nothing yet
    idx.synced(0.0)
    producer = per_block()
    vs = [view("a", idx)]
    req = request(blocks=(1, 2, 3))
    s = CycleState(req, 0.0, random.Random(0))
    producer.produce(req, vs, vs, s)
    producer.after_pick(req, vs[0], s)  # routed there; its blocks are not in the events yet
    assert cached(producer, req, vs, now=1.0) == ({"a": 3 * BS}, "exact")  # pending
    idx.synced(10.0)
    assert cached(producer, req, vs, now=10.0) == ({"a": 0}, "exact")  # 10 s on, still no event: gone


def test_an_incomplete_index_is_a_floor_under_the_estimate() -> None:
    idx = ReplicaBlockIndex()
    idx.reset(complete=False)  # joined late: holds a subset of the engine's blocks
    idx.apply(batch(stored([11], None, PROMPT[:4])))
    idx.synced(0.0)
    producer = per_block()
    vs = [view("a", idx)]
    req = request(blocks=(1, 2, 3))
    assert cached(producer, req, vs, now=0.0) == ({"a": BS}, "exact")
    s = CycleState(req, 0.0, random.Random(0))
    producer.after_pick(req, vs[0], s)
    assert cached(producer, req, vs, now=1.0) == ({"a": 3 * BS}, "exact")  # what this gateway sent


def test_the_default_profile_routes_a_follow_up_to_the_replica_holding_its_prefix() -> None:
    clock = ManualClock(50.0)
    router = build_router(None, clock=clock, seed=0)
    holder = index(stored([11, 12, 13], None, PROMPT[:12]))
    empty = index()
    for i in (holder, empty):
        i.synced(50.0)
    vs = [view("a", empty), view("b", holder), view("c", empty)]
    result = router.route(request(PROMPT * 8), vs)
    assert result is not None and result.replica.name == "b" and result.notes["kv_index"] == "exact"
    clock.advance(30.0)  # the streams went quiet and nothing proves them current: estimate only
    result = router.route(request(PROMPT * 8), vs)
    assert result is not None and result.notes["kv_index"] == "estimate"


# -- in virtual time: the engine's hook instead of sockets ------------------------------------------


def test_the_virtual_cluster_feeds_an_index_in_process() -> None:
    from tidal.replicas.sim.virtual import SimRequest, VirtualCluster

    cluster = VirtualCluster(preset="llama-3.1-8b-h100", replicas=2, seed=0, enable_kv_cache_events=True)
    indexes = [ReplicaBlockIndex(), ReplicaBlockIndex()]
    for eng, idx in zip(cluster.engines, indexes, strict=True):
        idx.reset(complete=True)
        eng.on_kv_events = lambda events, idx=idx: idx.apply(KVEventBatch(0.0, events))  # type: ignore[misc]
    prompt = list(range(1, 2001))
    cluster.at(0.0, lambda c: c.submit(1, SimRequest("r1", max_tokens=8, prompt_token_ids=prompt)))
    cluster.run()
    assert indexes[0].leading(chain_keys(prompt, 16)) == 0
    assert indexes[1].leading(chain_keys(prompt, 16)) == 2000 // 16
