"""Continuous batching in vLLM v1's shape: ``schedule()`` then ``update_from_output()``.

NOTE on the algorithm (after vLLM's ``Scheduler.schedule``): there is no prefill phase and no
decode phase. Each request has ``num_computed_tokens`` catching up to ``num_tokens``; every step
one token budget (``max_num_batched_tokens``) is shared, first by the RUNNING requests in order
(a decode needs 1 token, a prefill chunk up to the rest of the budget), then by WAITING requests
admitted while the budget, ``max_num_seqs``, the LoRA slots and the KV blocks allow. When a
running request cannot get a block, the lowest-priority running request is preempted
(recompute: its blocks are freed, it goes back to the front of the waiting queue): under the
``priority`` policy the one with the largest ``(priority, arrival_time)``, under ``fcfs`` the
last one running. The step's invariants are asserted at the end of every ``schedule()``.

Between two steps that only decode the same requests, nothing changes but their lengths, so
``fast_forward(k)`` applies ``k`` such steps at once (same block ids, same eviction order as
stepping) for the virtual-time runner.

Example::

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv_manager)
    sched.add_request(req)
    out = sched.schedule()                 # who runs, how many tokens each
    finished = sched.update_from_output(out, now=0.016)
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from tidal.replicas.sim.kv_cache_manager import KVCacheManager
from tidal.replicas.sim.request import Request, RequestStatus

__all__ = [
    "FCFSRequestQueue",
    "PriorityRequestQueue",
    "RequestQueue",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "create_request_queue",
]

Policy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine arguments that shape scheduling (names as vLLM's flags)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    policy: Policy = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_loras: int = 0  # 0: LoRA disabled
    # Deep consistency checks of the block pool after every step (tests; O(blocks) per step).
    check_invariants: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be positive")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")


# -- waiting queues (vLLM's request_queue.py) ---------------------------------------------------


class RequestQueue:
    """The waiting queue's interface; ``create_request_queue`` picks the policy's implementation."""

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def pop_request(self) -> Request:
        raise NotImplementedError

    def peek_request(self) -> Request:
        raise NotImplementedError

    def prepend_request(self, request: Request) -> None:
        raise NotImplementedError

    def prepend_requests(self, requests: deque[Request]) -> None:
        raise NotImplementedError

    def remove_requests(self, requests: Iterable[Request]) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    def unordered(self) -> Iterator[Request]:
        """The waiting requests in no particular order (cheaper than iterating in order)."""
        return iter(self)

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def pop_request(self) -> Request:
        return self._q.popleft()

    def peek_request(self) -> Request:
        return self._q[0]

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def prepend_requests(self, requests: deque[Request]) -> None:
        # `requests` was filled with appendleft, so extendleft restores the original order.
        self._q.extendleft(requests)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue(RequestQueue):
    """A heap on ``(priority, arrival_time)``: a smaller vLLM priority value runs sooner."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)  # a heap has no front; the order decides

    def prepend_requests(self, requests: deque[Request]) -> None:
        for r in requests:
            self.add_request(r)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))

    def unordered(self) -> Iterator[Request]:
        return iter(self._heap)


def create_request_queue(policy: Policy) -> RequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()


# -- scheduler ----------------------------------------------------------------------------------


@dataclass
class SchedulerOutput:
    """What one step runs. ``num_scheduled_tokens[id]`` tokens of each request are computed."""

    scheduled_new_reqs: list[Request] = field(default_factory=list)
    scheduled_resumed_reqs: list[Request] = field(default_factory=list)
    scheduled_running_reqs: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_reqs: list[Request] = field(default_factory=list)
    # Aggregates the cost model needs (filled by schedule()).
    num_seqs: int = 0
    num_sampled: int = 0
    kv_context_tokens: int = 0  # prior tokens whose KV each scheduled request reads
    attention_pairs: int = 0  # (query, key) pairs attended, summed over the batch
    num_prefill_tokens: int = 0
    # The scheduler's change counter when this step was scheduled (see Scheduler._changes).
    changes_seen: int = 0

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls()

    @property
    def all_scheduled(self) -> list[Request]:
        return self.scheduled_running_reqs + self.scheduled_new_reqs + self.scheduled_resumed_reqs


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups at admission, in tokens (preempted requests counted apart, as vLLM)."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


TokenSource = Callable[[Request], int]


class Scheduler:
    """One replica's scheduler. ``token_source(request)`` gives the next sampled token id."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        token_source: TokenSource | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.token_source = token_source
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_preemptions = 0
        self.lora_enabled = config.max_loras > 0
        # Set when the last step decoded exactly the running set and nothing else can change
        # until an outside event (new request, abort) arrives: fast_forward may then apply more
        # steps of the same shape.
        self._steady = False
        # Bumped by every outside change (a new request, an abort); a step scheduled before the
        # latest change cannot vouch that the next step looks the same.
        self._changes = 0
        # LoRA adapters whose requests were skipped in the last waiting pass (for the metrics).
        self.skipped_lora_ids: set[int] = set()

    # -- requests in and out ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        self._steady = False
        self._changes += 1

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise finish) requests wherever they are; their blocks are freed."""
        assert RequestStatus.is_finished(status)
        done: list[Request] = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove_requests([req])
            req.status = status
            self.kv_cache_manager.free(req)
            done.append(req)
        if done:
            self._steady = False
            self._changes += 1
        return done

    def has_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        running = self.running
        out = SchedulerOutput(changes_seen=self._changes)
        scheduled_running = out.scheduled_running_reqs
        preempted = out.preempted_reqs
        num_scheduled = out.num_scheduled_tokens
        token_budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold if len(running) + len(self.waiting) > 1 else 0
        priority_policy = cfg.policy == "priority"

        # First, the RUNNING requests.
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_new = request.num_tokens - request.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > token_budget:
                num_new = token_budget
            if num_new <= 0:
                req_index += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                # Cannot fit: preempt the lowest-priority running request (maybe this one).
                if priority_policy:
                    victim = max(running, key=lambda r: (r.priority, r.arrival_time))
                    victim_index = running.index(victim)
                    del running[victim_index]
                    if victim_index < req_index:
                        req_index -= 1
                    if victim in scheduled_running:
                        scheduled_running.remove(victim)
                        token_budget += num_scheduled.pop(victim.request_id)
                else:
                    victim = running.pop()
                self._preempt_request(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
            req_index += 1

        scheduled_loras: set[int] = set()
        if self.lora_enabled:
            scheduled_loras = {r.lora_id for r in scheduled_running if r.lora_id}
            assert len(scheduled_loras) <= cfg.max_loras

        # Next, the WAITING requests, unless this step had to preempt.
        self.skipped_lora_ids = set()
        if not preempted:
            waiting = self.waiting
            skipped: deque[Request] = deque()
            while waiting and token_budget > 0:
                if len(running) >= cfg.max_num_seqs:
                    break
                request = waiting.peek_request()
                if (
                    self.lora_enabled
                    and request.lora_id
                    and len(scheduled_loras) >= cfg.max_loras
                    and request.lora_id not in scheduled_loras
                ):
                    # No free LoRA slot for this adapter this step: skip it, keep its place.
                    skipped.appendleft(waiting.pop_request())
                    self.skipped_lora_ids.add(request.lora_id)
                    continue
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_hit_tokens
                if 0 < threshold < num_new:
                    num_new = threshold
                if not cfg.enable_chunked_prefill and num_new > token_budget:
                    break
                if num_new > token_budget:
                    num_new = token_budget
                new_blocks = kv.allocate_slots(
                    request, num_new, num_hit_tokens, hit_blocks, has_scheduled_reqs=bool(running)
                )
                if new_blocks is None:
                    break
                self._record_prefix_lookup(request, num_hit_tokens)
                waiting.pop_request()
                running.append(request)
                if request.status == RequestStatus.WAITING:
                    out.scheduled_new_reqs.append(request)
                else:
                    out.scheduled_resumed_reqs.append(request)
                if request.lora_id and self.lora_enabled:
                    scheduled_loras.add(request.lora_id)
                num_scheduled[request.request_id] = num_new
                token_budget -= num_new
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
            if skipped:
                waiting.prepend_requests(skipped)

        # The step's invariants.
        total = cfg.max_num_batched_tokens - token_budget
        assert total == sum(num_scheduled.values())
        assert 0 <= total <= cfg.max_num_batched_tokens
        assert token_budget >= 0
        assert len(running) <= cfg.max_num_seqs
        assert len(out.scheduled_new_reqs) + len(out.scheduled_resumed_reqs) + len(scheduled_running) <= len(
            running
        )
        out.total_num_scheduled_tokens = total
        self._update_after_schedule(out)
        if cfg.check_invariants:
            self.check_invariants()
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        # Advance num_computed_tokens now, so a chunked prefill can be scheduled again next
        # step; gather the aggregates the cost model needs on the way.
        num_scheduled = out.num_scheduled_tokens
        kv_ctx = pairs = sampled = prefill = 0
        seqs = 0
        for reqs in (out.scheduled_running_reqs, out.scheduled_new_reqs, out.scheduled_resumed_reqs):
            for r in reqs:
                n = num_scheduled[r.request_id]
                before = r.num_computed_tokens
                kv_ctx += before
                pairs += n * before + n * (n + 1) // 2
                r.num_computed_tokens = before + n
                if r.num_computed_tokens >= r.num_tokens and not r.pooling:
                    sampled += 1
                if before < r.num_prompt_tokens:
                    prefill += min(n, r.num_prompt_tokens - before)
                seqs += 1
        out.num_seqs = seqs
        out.kv_context_tokens = kv_ctx
        out.attention_pairs = pairs
        out.num_sampled = sampled
        out.num_prefill_tokens = prefill

    def _preempt_request(self, request: Request) -> None:
        assert request.status == RequestStatus.RUNNING, "only running requests can be preempted"
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _record_prefix_lookup(self, request: Request, num_hits: int) -> None:
        stats = self.prefix_cache_stats
        if not self.kv_cache_manager.enable_caching or request.pooling:
            return
        if request.num_preemptions > 0:
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hits
        else:
            stats.queries += request.num_tokens
            stats.hits += num_hits

    def update_from_output(self, out: SchedulerOutput) -> tuple[list[Request], list[Request]]:
        """Sample one token for every request whose computed tokens caught up; finish the done ones.

        Returns ``(with_new_token, finished)``: the requests that produced output this step (a
        token, or for pooling requests their result) and those that finished. Requests aborted
        while the step ran are skipped.
        """
        produced: list[Request] = []
        finished: list[Request] = []
        token_source = self.token_source
        steady = not out.scheduled_new_reqs and not out.scheduled_resumed_reqs and not out.preempted_reqs
        if len(out.scheduled_running_reqs) != len(self.running) or out.changes_seen != self._changes:
            steady = False
        for reqs in (out.scheduled_running_reqs, out.scheduled_new_reqs, out.scheduled_resumed_reqs):
            for r in reqs:
                if r.status != RequestStatus.RUNNING:
                    steady = False
                    continue
                if r.num_computed_tokens < r.num_tokens:
                    steady = False  # a prefill chunk: no token yet
                    continue
                if out.num_scheduled_tokens[r.request_id] != 1:
                    steady = False
                if r.pooling:
                    r.status = RequestStatus.FINISHED_STOPPED
                    produced.append(r)
                    finished.append(r)
                    continue
                if r.output_token_ids is not None and token_source is not None:
                    r.output_token_ids.append(token_source(r))
                r.num_output_tokens += 1
                produced.append(r)
                n_out = r.num_output_tokens
                if n_out >= r.max_tokens:
                    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    finished.append(r)
                elif r.stop_after is not None and n_out >= r.stop_after:
                    r.status = RequestStatus.FINISHED_STOPPED
                    finished.append(r)
        if finished:
            steady = False
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for r in finished:
                self.requests.pop(r.request_id, None)
                self.kv_cache_manager.free(r)
        self._steady = steady and bool(self.running)
        return produced, finished

    # -- fast forward (virtual time) ----------------------------------------------------------

    def can_fast_forward(self) -> bool:
        """True when the next steps would decode exactly the current running set."""
        return self._steady

    def max_fast_forward_steps(self, limit: int) -> int:
        """How many steady decode steps can run before one must be stepped normally.

        The bound comes from the first request to finish (that step is taken normally) and from
        the free blocks (a step that would need a preemption is taken normally).
        """
        if not self._steady or limit <= 0:
            return 0
        running = self.running
        k = limit
        for r in running:
            rem = r.max_output_tokens - r.num_output_tokens - 1
            if rem < k:
                k = rem
        if k <= 0:
            return 0
        free = self.kv_cache_manager.block_pool.free_block_queue.num_free_blocks
        if self._blocks_needed(k) <= free:
            return k
        lo, hi = 0, k  # blocks_needed(lo) <= free < blocks_needed(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._blocks_needed(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def _blocks_needed(self, k: int) -> int:
        # Step j (1-based) of a decode run needs slots for num_tokens + j - 1 tokens.
        bs = self.block_size
        held = self.kv_cache_manager.num_blocks
        need = 0
        for r in self.running:
            need += -(-(r.num_tokens + k - 1) // bs) - held(r.request_id)
        return need

    def fast_forward(self, k: int) -> None:
        """Apply ``k`` steady decode steps (``k <= max_fast_forward_steps``) in one go.

        New blocks are taken in the order stepping would take them (step by step, running
        order), so block ids and the eviction order are exactly those of ``k`` single steps.
        """
        if k <= 0:
            return
        bs = self.block_size
        kv = self.kv_cache_manager
        pool = kv.block_pool
        running = self.running
        # Step j allocates a block for request r when slot index num_tokens + j - 2 starts one:
        # first at j0 = ((1 - num_tokens) mod bs) + 1, then every bs steps.
        firsts = sorted(
            ((((1 - r.num_tokens) % bs) + 1, i) for i, r in enumerate(running)),
        )
        if firsts and firsts[0][0] <= k:
            lists = [kv.req_to_blocks[r.request_id] for r in running]
            m = 0
            while m * bs + 1 <= k:
                any_left = False
                for j0, i in firsts:
                    if j0 + m * bs <= k:
                        lists[i].extend(pool.get_new_blocks(1))
                        any_left = True
                if not any_left:
                    break
                m += 1
        token_source = self.token_source
        for r in running:
            if r.output_token_ids is not None and token_source is not None:
                for _ in range(k):
                    r.output_token_ids.append(token_source(r))
            r.num_computed_tokens += k
            r.num_output_tokens += k
            if kv.enable_caching:
                kv.cache_blocks(r, r.num_computed_tokens)
        if self.config.check_invariants:
            self.check_invariants()

    # -- checks --------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Deep consistency checks (tests run them after every step)."""
        kv = self.kv_cache_manager
        bs = self.block_size
        assert len(self.running) <= self.config.max_num_seqs
        seen: set[str] = set()
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, r
            assert r.num_computed_tokens <= r.num_tokens <= self.config.max_model_len, r
            assert kv.num_blocks(r.request_id) >= -(-r.num_computed_tokens // bs), r
            seen.add(r.request_id)
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            assert r.num_computed_tokens == 0 and kv.num_blocks(r.request_id) == 0, r
            seen.add(r.request_id)
        assert seen == set(self.requests), "requests dict out of sync with the queues"
        refs: dict[int, int] = {}
        for blocks in kv.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in kv.block_pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"{b} ref count != holders {refs.get(b.block_id)}"
        kv.block_pool.check_invariants()
