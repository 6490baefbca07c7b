"""The planner's fleet model: a request-level queueing model of replicas that batch continuously.

It predicts a fleet's TTFT and TPOT percentiles without the simulator's engine, from what a
replica is made of: the cost model's step time (:class:`~replicas.sim.cost.CostModel`), the token
budget of a step, the batch cap and the KV capacity. Each replica is a queue in front of a batch:

* arrivals go to the replica with the fewest requests in flight (ties rotate), as in
  :func:`~scheduler.plan.replay.replay_fleet`;
* a replica admits waiting requests first come, first served while it runs fewer than the batch
  cap; a step gives each running request in admission order its share of the token budget
  (one token to a decoding request, the rest of its prompt, up to what is left, to a
  prefilling one), then admits new ones into what is left (chunked prefill);
* the step lasts ``CostModel.step_time`` of its tokens, sequences and attention; runs of pure
  decode steps are summed in closed form (a decode step is ``a + s x context``);
* prefix reuse is a per-replica LRU of the workload's prefix ids (``TraceRequest.hash_ids``) as
  large as the replica's KV cache; a prompt's leading run of ids held there is not recomputed.

What it leaves out, and the replay keeps: KV blocks and preemption (the cache is taken as never
full for running requests), the engine's 16-token block hashing and eviction order, LoRA slots.
Comparing it with a replay of the same workload (:mod:`scheduler.plan.replay`) is the planner's
check of its own prediction.

Example::

    stats = predict_fleet(preset, workload.scaled_to(40.0), replicas=8, max_num_seqs=160)
    stats.ttft_p95_s, stats.tpot_p95_s
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque

from tidal.replicas.sim.cost import CostModel
from tidal.replicas.sim.presets import Preset
from tidal.scheduler.plan.replay import LatencyStats, stats_of
from tidal.scheduler.plan.workload import Workload

__all__ = ["predict_fleet"]


class _Req:
    __slots__ = ("arrival", "cached", "computed", "first", "gen", "ids", "output", "prompt", "rem")

    def __init__(self, arrival: float, prompt: int, output: int, ids: tuple[int, ...]) -> None:
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.ids = ids
        self.rem = 0  # prompt tokens still to compute
        self.computed = 0  # tokens with KV
        self.gen = 0  # output tokens produced
        self.cached = 0
        self.first: float | None = None


class _Replica:
    __slots__ = (
        "busy",
        "ctx",
        "cost",
        "lru",
        "lru_cap",
        "planned",
        "prefilling",
        "running",
        "run_steps",
        "run_start",
        "version",
        "waiting",
    )

    def __init__(self, cost: CostModel, lru_cap: int) -> None:
        self.cost = cost
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []  # admission order
        self.prefilling = 0  # running requests with prompt tokens left
        self.ctx = 0  # sum of computed tokens of the running requests
        self.lru: OrderedDict[int, int] = OrderedDict()  # prefix id -> tokens of it cached
        self.lru_cap = lru_cap
        self.busy = False
        self.version = 0
        # A run of pure decode steps in progress: its start and its length in steps.
        self.run_start = 0.0
        self.run_steps = 0
        self.planned: list[_Req] = []  # what the step under way produces (a normal step)


class _Fleet:
    def __init__(self, preset: Preset, replicas: int, cap: int, block_tokens: int) -> None:
        cost = preset.cost
        self.budget = preset.max_num_batched_tokens
        self.cap = cap
        self.block = preset.block_size
        self.max_len = preset.context_len
        kv_tokens = preset.num_gpu_blocks * preset.block_size
        self.block_tokens = block_tokens
        self.reps = [_Replica(cost, max(1, kv_tokens // block_tokens)) for _ in range(replicas)]
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, replica, version)
        self.seq = 0
        self.rows: list[tuple[float, float | None, float, int, int, int]] = []
        self._a: dict[int, float] = {}
        _, self._s = cost.decode_terms(1)
        self.turn = 0

    # -- arrivals ------------------------------------------------------------------------------

    def dispatch(self, req: _Req, now: float) -> None:
        n = len(self.reps)
        loads = [len(r.waiting) + len(r.running) for r in self.reps]
        least = min(loads)
        for j in range(n):
            i = (self.turn + j) % n
            if loads[i] == least:
                break
        self.turn = i + 1
        rep = self.reps[i]
        rep.waiting.append(req)
        if not rep.busy:
            self._step(i, now)
        elif rep.run_steps:
            self._cut_run(i, now)

    # -- decode runs ---------------------------------------------------------------------------

    def _decode_a(self, batch: int) -> float:
        a = self._a.get(batch)
        if a is None:
            a = self.reps[0].cost.decode_terms(batch)[0]
            self._a[batch] = a
        return a

    def _run_time(self, batch: int, ctx: int, k: int) -> float:
        """k pure decode steps of ``batch`` requests holding ``ctx`` tokens: sum of a + s x context."""
        return k * self._decode_a(batch) + self._s * (k * ctx + batch * k * (k - 1) / 2)

    def _steps_begun_before(self, batch: int, ctx: int, dt: float) -> int:
        """The smallest k whose k steps end at or after ``dt`` from the run's start."""
        a, s = self._decode_a(batch), self._s
        # s*B/2 k^2 + (a + s*ctx - s*B/2) k - dt = 0
        qa, qb = s * batch / 2, a + s * ctx - s * batch / 2
        k = dt / qb if qa <= 0 else (-qb + math.sqrt(qb * qb + 4 * qa * dt)) / (2 * qa)
        k = max(1, math.ceil(k - 1e-9))
        while k > 1 and self._run_time(batch, ctx, k - 1) >= dt:
            k -= 1
        while self._run_time(batch, ctx, k) < dt:
            k += 1
        return k

    def _cut_run(self, i: int, now: float) -> None:
        # Something arrived mid-run: the run ends with the step under way.
        rep = self.reps[i]
        k = self._steps_begun_before(len(rep.running), rep.ctx, now - rep.run_start)
        if k < rep.run_steps:
            rep.run_steps = k
            self._push(i, rep.run_start + self._run_time(len(rep.running), rep.ctx, k))

    # -- steps ---------------------------------------------------------------------------------

    def _push(self, i: int, t: float) -> None:
        rep = self.reps[i]
        rep.version += 1
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, i, rep.version))

    def _lookup(self, rep: _Replica, req: _Req) -> int:
        hit = 0
        bt = self.block_tokens
        lru = rep.lru
        for j, h in enumerate(req.ids):
            held = lru.get(h)
            if held is None:
                break
            lru.move_to_end(h)
            need = min(bt, req.prompt - j * bt)
            hit += min(held, need)
            if held < need:  # a partial block (the end of an earlier prompt): the match ends in it
                break
        # At most prompt - 1 tokens hit, in whole engine blocks (the last token is recomputed).
        hit = min(hit, req.prompt - 1)
        return hit - hit % self.block

    def _remember(self, rep: _Replica, req: _Req) -> None:
        bt, block, lru = self.block_tokens, self.block, rep.lru
        for j in range(len(req.ids) - 1, -1, -1):
            h = req.ids[j]
            tokens = min(bt, req.prompt - j * bt)
            tokens -= tokens % block  # only full engine blocks are cached
            if tokens <= 0:
                continue
            lru[h] = max(tokens, lru.get(h, 0))
            lru.move_to_end(h)
        while len(lru) > rep.lru_cap:
            lru.popitem(last=False)

    def _step(self, i: int, now: float) -> None:
        rep = self.reps[i]
        rep.busy = True
        rep.run_steps = 0
        if not rep.prefilling and rep.running and (not rep.waiting or len(rep.running) >= self.cap):
            # Pure decode until the first request finishes (or something arrives: _cut_run).
            k = min(r.output - r.gen for r in rep.running)
            rep.run_start = now
            rep.run_steps = k
            self._push(i, now + self._run_time(len(rep.running), rep.ctx, k))
            return
        budget = self.budget
        tokens = seqs = sampled = kv = 0
        pairs = 0
        planned: list[_Req] = []
        for r in rep.running:
            if budget <= 0:
                break
            n = min(r.rem, budget) if r.rem else 1
            kv += r.computed
            pairs += n * r.computed + n * (n + 1) // 2
            budget -= n
            tokens += n
            seqs += 1
            if r.rem <= n:
                sampled += 1
            planned.append(r)
        while rep.waiting and budget > 0 and len(rep.running) < self.cap:
            r = rep.waiting.popleft()
            r.cached = self._lookup(rep, r)
            r.computed = r.cached
            r.rem = r.prompt - r.cached
            rep.running.append(r)
            rep.prefilling += 1
            rep.ctx += r.computed
            n = min(r.rem, budget)
            kv += r.computed
            pairs += n * r.computed + n * (n + 1) // 2
            budget -= n
            tokens += n
            seqs += 1
            if r.rem <= n:
                sampled += 1
            planned.append(r)
        if not tokens:
            rep.busy = False
            return
        rep.planned = planned
        self._push(i, now + rep.cost.step_time(tokens, seqs, sampled, kv, pairs))

    def _end_step(self, i: int, now: float) -> None:
        rep = self.reps[i]
        done: list[_Req] = []
        if rep.run_steps:
            k = rep.run_steps
            rep.ctx += k * len(rep.running)
            for r in rep.running:
                r.gen += k
                r.computed += k
                if r.gen >= r.output:
                    done.append(r)
            rep.run_steps = 0
        else:
            budget = self.budget
            for r in rep.planned:
                if r.rem:
                    n = min(r.rem, budget)
                    budget -= n
                    r.rem -= n
                    r.computed += n
                    rep.ctx += n
                    if r.rem == 0:
                        rep.prefilling -= 1
                        r.first = now
                        r.gen = 1
                        self._remember(rep, r)
                else:
                    budget -= 1
                    r.gen += 1
                    r.computed += 1
                    rep.ctx += 1
                if r.rem == 0 and r.gen >= r.output:
                    done.append(r)
            rep.planned = []
        if done:
            gone = set(map(id, done))
            rep.running = [r for r in rep.running if id(r) not in gone]
            for r in done:
                # Its blocks are freed now: the most recently used of the cache, first ids last.
                self._remember(rep, r)
                rep.ctx -= r.computed
                ttft = None if r.first is None else r.first - r.arrival
                self.rows.append((r.arrival, ttft, now, r.prompt, r.cached, r.gen))
        if rep.running or rep.waiting:
            self._step(i, now)
        else:
            rep.busy = False

    def run(self, arrivals: list[tuple[float, _Req]]) -> None:
        k = 0
        events = self.events
        while k < len(arrivals) or events:
            if k < len(arrivals) and (not events or arrivals[k][0] <= events[0][0]):
                t, req = arrivals[k]
                k += 1
                self.dispatch(req, t)
                continue
            t, _, i, version = heapq.heappop(events)
            if version != self.reps[i].version:
                continue
            self._end_step(i, t)


def predict_fleet(
    preset: Preset,
    workload: Workload,
    replicas: int,
    *,
    max_num_seqs: int | None = None,
    warmup_fraction: float = 0.1,
    keep_samples: bool = False,
) -> LatencyStats:
    """TTFT/TPOT percentiles the fleet model predicts for ``workload`` on ``replicas`` replicas of
    ``preset`` with a batch cap of ``max_num_seqs`` (default: the preset's)."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    reqs = workload.requests
    block_tokens = reqs[0].block_tokens
    fleet = _Fleet(preset, replicas, max_num_seqs or preset.max_num_seqs, block_tokens)
    t0 = reqs[0].arrival_s
    max_len = preset.context_len
    arrivals = []
    for r in reqs:
        prompt = min(r.input_length, max_len - 2)
        output = max(1, min(r.output_length, max_len - prompt - 1))
        arrivals.append((r.arrival_s - t0, _Req(r.arrival_s - t0, prompt, output, r.hash_ids)))
    fleet.run(arrivals)
    start = warmup_fraction * (reqs[-1].arrival_s - t0)
    return stats_of(fleet.rows, start, keep_samples=keep_samples)
