"""The scheduler and KV-cache manager on tiny exact configs (16-token blocks, a dozen blocks).

Every test runs with ``check_invariants=True``: the scheduler asserts its step invariants and
the block pool's bookkeeping after every step.
"""

from __future__ import annotations

import random

import pytest

from tidal.replicas.sim.block_pool import BlockPool
from tidal.replicas.sim.kv_cache_manager import KVCacheManager
from tidal.replicas.sim.request import Request, RequestStatus
from tidal.replicas.sim.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 16


def make_sched(num_blocks: int = 12, **cfg: object) -> Scheduler:
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, block_size=BS, max_model_len=int(cfg.pop("max_model_len", 1024)))  # type: ignore[call-overload]
    config = SchedulerConfig(check_invariants=True, max_model_len=kv.max_model_len, **cfg)  # type: ignore[arg-type]
    return Scheduler(config, kv, token_source=lambda r: 7)


def req(
    rid: str,
    tokens: list[int],
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival: float = 0.0,
    lora: int = 0,
) -> Request:
    r = Request(
        rid,
        num_prompt_tokens=len(tokens),
        max_tokens=max_tokens,
        block_size=BS,
        prompt_token_ids=tokens,
        priority=priority,
        lora_id=lora,
    )
    r.arrival_time = arrival
    return r


def ids(s: Scheduler, r: Request) -> list[int]:
    return s.kv_cache_manager.get_block_ids(r.request_id)


def free_ids(s: Scheduler) -> list[int]:
    return [b.block_id for b in s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()]


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out)
    return out


# -- KV-cache manager --------------------------------------------------------------------------


def test_prefix_hit_shares_blocks_and_stops_at_the_first_miss() -> None:
    s = make_sched()
    kv = s.kv_cache_manager
    # Given A (3 full blocks + 2 tokens) computed and cached
    a = req("a", list(range(50)))
    s.add_request(a)
    step(s)
    assert ids(s, a) == [1, 2, 3, 4]
    # When B shares A's first two blocks and then diverges
    b = req("b", list(range(32)) + [999] * 20)
    hit, n = kv.get_computed_blocks(b)
    # Then it hits exactly blocks 1 and 2
    assert [x.block_id for x in hit] == [1, 2] and n == 32
    s.add_request(b)
    step(s)
    assert ids(s, b) == [1, 2, 5, 6]
    assert s.prefix_cache_stats.hits == 32 and s.prefix_cache_stats.queries == 50 + 52


def test_a_full_prompt_hit_still_recomputes_the_last_block() -> None:
    # The last token is always recomputed for its logits: 32 cached tokens hit only 1 block.
    s = make_sched()
    a = req("a", list(range(32)), max_tokens=1)
    s.add_request(a)
    step(s)
    assert a.is_finished
    b = req("b", list(range(32)))
    hit, n = s.kv_cache_manager.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [1] and n == 16


def test_allocate_slots_returns_none_when_free_blocks_do_not_suffice() -> None:
    s = make_sched(num_blocks=4)  # 3 usable blocks
    kv = s.kv_cache_manager
    big = req("big", list(range(64)))
    assert kv.allocate_slots(big, 64) is None  # needs 4
    assert kv.block_pool.get_num_free_blocks() == 3  # nothing taken
    small = req("small", list(range(48)))
    blocks = kv.allocate_slots(small, 48)
    assert blocks is not None and [b.block_id for b in blocks] == [1, 2, 3]


def test_free_cached_hit_blocks_count_against_free_blocks() -> None:
    # A hit on a free (evictable) block takes it out of the free pool, so it costs a block too.
    s = make_sched(num_blocks=4)
    a = req("a", list(range(33)), max_tokens=1)
    s.add_request(a)
    step(s)  # blocks 1,2 cached and free again; 3 free
    assert a.is_finished and free_ids(s) == [3, 2, 1]
    b = req("b", list(range(32)) + [5] * 32)  # hits blocks 1,2; needs 2 more: 4 > 3 free
    hit, n = s.kv_cache_manager.get_computed_blocks(b)
    assert n == 32
    assert s.kv_cache_manager.allocate_slots(b, 32, n, hit) is None


# -- token budget and chunked prefill ------------------------------------------------------------


def test_one_token_budget_is_shared_running_first() -> None:
    s = make_sched(num_blocks=20, max_num_batched_tokens=64)
    a = req("a", list(range(100)), max_tokens=3)
    b = req("b", list(range(1000, 1030)), max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    # Step 1: A takes the whole budget (a 64-token chunk); B waits.
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 64}
    # Step 2: A's remaining 36 tokens run first, B gets the 28 left (chunked).
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 36, "b": 28}
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    # Step 3: A decodes (1 token), B finishes its prompt (2 tokens).
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert out.total_num_scheduled_tokens == 3


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make_sched(num_blocks=20, max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", [i] * 20, max_tokens=2))
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"} and len(s.running) == 2
    step(s)  # r0, r1 produce their second token and finish
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"r2"}


def test_chunked_prefill_off_waits_for_the_whole_prompt() -> None:
    s = make_sched(num_blocks=20, max_num_batched_tokens=64, enable_chunked_prefill=False)
    s.add_request(req("a", list(range(40)), max_tokens=5))
    s.add_request(req("b", list(range(100, 140)), max_tokens=5))
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 40}  # b's 40 tokens do not fit in the 24 left


# -- preemption --------------------------------------------------------------------------------


def test_priority_policy_preempts_the_largest_priority_value() -> None:
    # Given two running requests that fill the pool (5 usable blocks, 16-token blocks)
    s = make_sched(num_blocks=6, policy="priority")
    hi = req("hi", [1] * 32, max_tokens=40, priority=0, arrival=1.0)
    lo = req("lo", [2] * 31, max_tokens=40, priority=5, arrival=0.0)
    s.add_request(hi)
    s.add_request(lo)
    step(s)
    assert ids(s, hi) == [1, 2] and ids(s, lo) == [3, 4]
    out = step(s)  # hi's 33rd token takes the last free block
    assert ids(s, hi) == [1, 2, 5] and free_ids(s) == []
    # When lo needs a third block and none is free
    out = step(s)
    # Then lo (priority 5, though it arrived first) is the victim, recomputed from scratch later
    assert [r.request_id for r in out.preempted_reqs] == ["lo"]
    assert lo.status == RequestStatus.PREEMPTED and lo.num_computed_tokens == 0 and lo.num_preemptions == 1
    assert s.num_preemptions == 1 and ids(s, lo) == []
    assert list(s.waiting)[0] is lo


def test_fcfs_policy_preempts_the_last_running_request() -> None:
    s = make_sched(num_blocks=6, policy="fcfs")
    first = req("first", [1] * 32, max_tokens=40, priority=9)
    last = req("last", [2] * 31, max_tokens=40, priority=0)
    s.add_request(first)
    s.add_request(last)
    out = step(s)
    while not out.preempted_reqs:
        out = step(s)
    assert [r.request_id for r in out.preempted_reqs] == ["last"]


def test_a_request_that_cannot_fit_preempts_itself_and_stops_the_step() -> None:
    s = make_sched(num_blocks=4)  # 3 usable blocks = 48 tokens
    only = req("only", [3] * 40, max_tokens=20)
    s.add_request(only)
    out = step(s)
    while not out.preempted_reqs:
        out = step(s)
    assert out.preempted_reqs == [only] and out.total_num_scheduled_tokens == 0
    assert only.status == RequestStatus.PREEMPTED


# -- LoRA slots ---------------------------------------------------------------------------------


def test_requests_for_an_adapter_without_a_slot_wait_their_turn() -> None:
    s = make_sched(num_blocks=20, max_loras=1)
    a = req("a", [1] * 10, max_tokens=2, lora=1)
    b = req("b", [2] * 10, max_tokens=2, lora=2)
    c = req("c", [3] * 10, max_tokens=2, lora=1)
    base = req("base", [4] * 10, max_tokens=2)
    for r in (a, b, c, base):
        s.add_request(r)
    out = step(s)
    # b (adapter 2) is skipped: the only slot holds adapter 1; c (adapter 1) and base run.
    assert set(out.num_scheduled_tokens) == {"a", "c", "base"}
    assert s.skipped_lora_ids == {2} and list(s.waiting) == [b]
    step(s)  # a, c, base finish
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"b"}


# -- aborts -------------------------------------------------------------------------------------


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    s = make_sched(num_blocks=12, max_num_seqs=1)
    a = req("a", [1] * 40, max_tokens=10)
    b = req("b", [2] * 40, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert len(ids(s, a)) == 3
    done = s.finish_requests(["a", "b", "missing"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a", "b"]
    assert not s.has_requests() and s.kv_cache_manager.block_pool.get_num_free_blocks() == 11
    s.check_invariants()


# -- fast forward ------------------------------------------------------------------------------


def _state(s: Scheduler) -> tuple[object, ...]:
    pool = s.kv_cache_manager.block_pool
    return (
        free_ids(s),
        sorted(
            (h, b.block_id) for h, b in pool.cached_block_hash_to_block.items() if not isinstance(b, dict)
        ),
        {rid: s.kv_cache_manager.get_block_ids(rid) for rid in s.kv_cache_manager.req_to_blocks},
        [(r.request_id, r.num_computed_tokens, r.num_output_tokens) for r in s.running],
    )


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fast_forward_equals_stepping(seed: int) -> None:
    rng = random.Random(seed)

    def build() -> Scheduler:
        s = make_sched(num_blocks=40, max_num_batched_tokens=48, max_num_seqs=6)
        r2 = random.Random(seed)
        for i in range(8):
            n = r2.randint(5, 60)
            s.add_request(req(f"r{i}", [r2.randint(0, 3)] * n, max_tokens=r2.randint(5, 70)))
        return s

    a, b = build(), build()
    forwarded = 0
    while a.has_requests():
        k = a.max_fast_forward_steps(rng.randint(1, 40)) if a.can_fast_forward() else 0
        if k:
            assert b.can_fast_forward() and b.max_fast_forward_steps(k) == k
            a.fast_forward(k)
            forwarded += k
            for _ in range(k):
                out = b.schedule()
                assert out.total_num_scheduled_tokens == len(b.running)  # pure decode
                b.update_from_output(out)
        else:
            step(a)
            step(b)
        assert _state(a) == _state(b)
    assert not b.has_requests() and forwarded > 0
