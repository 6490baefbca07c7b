"""``tidal bench routing``: every routing policy on the same trace, load and simulated fleet.

Replays a trace on 8 simulated replicas of each Llama-3.1-70B FP8 on H200 preset -- 4 x H200
(``llama-3.1-70b-fp8-h200-tp4``, 1.44 M tokens of KV per replica) and 8 x H200 (``-tp8``, 3.1 M)
-- in virtual time (``replicas.sim.virtual``) through a *virtual gateway* made of the product's own objects --
the replica registry, the admission controller with the adaptive per-replica caps, and the
router with each built-in profile. Nothing here re-implements a policy: the profiles are
:mod:`router.profiles`.

**Each policy sees what its live system sees.**

* *Signals* (each table's ``signals`` line; rows carry ``signal_staleness_s``): ``llm_d`` reads
  the replicas' ``/metrics`` every 50 ms, its endpoint picker's default refresh; SGLang's
  cache-aware policy balances on its own in-flight counts; ``tidal`` reads the gateway's in-flight
  and prefill counts, the replicas' KV events and ``/metrics`` every 1 s, as the live gateway does.
* *Prompts* (:mod:`bench.prompt_views`): each trace request becomes the chat request its
  conversation implies (deterministic text per block id, at 3.2-4.8 characters a token), read by
  :func:`router.prefix.chat_view` -- the very function the live gateway calls -- for the stable
  prefix key, the 64-character blocks capped at 256 (``tidal``, and llm-d's prefix plugin, whose
  defaults are the same) and the bytes / 4 token estimate; SGLang's tree gets the whole prompt's
  blocks. ``tidal``'s KV index reads the engine's own block keys from the KV events, as the live
  gateway does where it has the model's tokenizer.
* *Sessions*: a turn that repeats an earlier request's prompt continues its conversation, whose
  id is the request's session key (``X-Session-Id``), so the live profile's session ring is
  exercised.

**Tuning is separate from scoring.** Every policy with parameters gets the same budget
(:data:`TUNING`: a 2 x 2 grid over its two main parameters, defaults included), tried on the
first half of the trace at 80 % load over :data:`TUNE_SEEDS` seeds; the setting with the lowest
TTFT p95 is scored on the second half. Rows carry ``tuned_params`` and ``tuned_on``; ``--tune
off`` scores the defaults on the whole trace.

**Every figure is a mean over seeds** (``--seeds``, 5): each seed jitters the arrivals (by up to
half the trace's mean gap; seed 0 replays them as recorded) and seeds the router's and the
simulator's randomness. Rows carry ``seeds``, ``ttft_p95_ci95_s`` and ``hit_ratio_ci95`` (95 %
Student intervals) and, on ``tidal``'s rows, ``verdict``: ``best`` when its TTFT p95 interval
lies below that of the next policy, ``behind`` when another's lies below its own, else ``tie``.
Replays run on ``--jobs`` processes (the machine's cores).

For each trace the capacity is measured first (requests per second the capped fleet completes
when saturated, round robin), then the trace's arrivals are rescaled to each load (50, 80, 95 %
of that capacity). **Load** is the trace's offered rate over that
capacity, the rate taken (``--load-basis``) in its busiest 5-minute window (``peak``, the
default) or over the whole trace (``mean``). The two agree for a steady trace (the Mooncake
conversation trace's busiest 5 minutes are 1.14 x its mean) but not for a bursty one: the Azure
code trace's are 1.79 x its mean, so at 80 % of capacity by the mean rate the fleet is offered
143 % of its capacity for minutes at a time and every policy queues for seconds. Rows carry both figures
(``mean_load``, ``peak_load``).

Rows give TTFT (from arrival at the gateway, queueing included) p50/p95/p99, TPOT p50/p95, the
prefix-cache hit ratio beside three bounds -- the trace's ideal (one infinite cache),
``capacity_hit_ratio`` (one LRU cache of the whole cluster's KV capacity: a router that must
place each prompt on one replica of an LRU engine, as vLLM is, can approach it but hardly beat
it) and ``belady_hit_ratio`` (that cache evicting the block needed furthest in the future
instead: on the Mooncake trace it reaches the whole ideal, so what separates LRU from the ideal
is the eviction policy, not the cluster's size) -- output throughput,
load imbalance (max / mean replica work), ``session_share`` (requests that continue a session
their gateway placed before) and ``session_stay`` (of those, the share placed where the
session's previous request went).

**KV events** (``--kv-events on``, the default): the replicas publish their KV events as vLLM's
``--kv-events-config`` does and every gateway follows them (:class:`VirtualKVEvents`: one
:class:`~router.kv_events.ReplicaBlockIndex` per replica, fed ``KV_EVENT_LATENCY_S`` = 5 ms
after the engine step that made them), so the ``kv-index`` producer (``tidal``'s prefill cost)
routes on what each replica holds; the other profiles read their own estimates. A trace names
blocks, not tokens: each 16-token block's token ids stand as its hash (:func:`trace_token_ids`),
on the events and on the prompts alike.

**Several gateways** (``--gateways 2``, the default for the full run; ``--gateways 1`` skips it):
each profile is replayed once more at 80 % load through that many gateways, every request sent
to one of them at random, as an L4 balancer would. They share what production gateways share
(rows ``sharing: shared``): the load state of :mod:`router.shared` -- each gateway's in flight and
not yet prefilled per replica, its queue, one adaptive cap per replica -- through the product's
own sync loop (:class:`~router.shared.SharedLoad`, every ``gateway.shared_state_interval_s``,
50 ms, at a random phase per gateway) on a :class:`VirtualLoadBoard` standing in for Redis, where
a publication reaches the others' reads one round trip later (``STORE_RTT_S`` = 10 ms: the
measured staleness, 0.03-0.12 s through three gateways, is at most two intervals plus two round
trips), and the KV events above. The cache-aware profiles are also replayed through gateways that
share nothing (``sharing: unshared``, no KV events: each its own registry, in-flight counts, caps,
queue and router indexes), the loss without sharing: a conversation's turns then reach gateways
that never saw its earlier turns. Rows carry ``gateways``, ``sharing`` (``single`` for one
gateway) and ``kv_events``.

Traces: the Mooncake conversation trace and the Azure code and conversation traces from
``../shared/traces/`` (or ``$TIDAL_TRACES_DIR``) and, in the full run or when no trace is found,
the built-in synthetic workload; or any ``--trace FILE`` (Mooncake JSONL or Azure CSV,
repeatable; ``--trace synthetic`` for the built-in one). Admission never refuses here (an hour-long
wait budget and an unbounded queue), so every policy serves every request and queueing shows in
TTFT.

Example::

    tidal bench routing --quick                     # TP4 only, one load, the first requests
    tidal bench routing --preset llama-3.1-70b-fp8-h200-tp8 --loads 0.8
    tidal bench routing --trace my_trace.jsonl --loads 0.5,0.9 --seeds 10
    tidal bench routing --load-basis mean --policies tidal,round_robin --tune off
    tidal bench routing --trace synthetic --loads 0.8 --gateways 4 --jobs 16
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import product
from pathlib import Path
from typing import Any

import click
import msgspec

from tidal.bench.prompt_views import RouteView, prepare_views
from tidal.bench.traces import (
    TraceRequest,
    belady_hit_ratio,
    block_hashes,
    capacity_hit_ratio,
    find_trace,
    ideal_hit_ratio,
    load_trace,
    synthetic_workload,
)
from tidal.fleet import FleetConfig, parse_fleet
from tidal.priority.admission import Admission, Decision, Ticket
from tidal.priority.window import quantile
from tidal.replicas.sim.presets import get_preset
from tidal.replicas.sim.virtual import SimRequest, SimResult, VirtualCluster
from tidal.replicas.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    external_hash,
)
from tidal.router.kv_events import PromptKeys, ReplicaBlockIndex
from tidal.router.loader import build_router
from tidal.router.profiles import BUILTIN_PROFILES, BUILTIN_ROUTER
from tidal.router.registry import ReplicaRegistry, ReplicaState
from tidal.router.shared import CapProposal, GatewayLoad, SharedCap, SharedLoad, SyncReply
from tidal.router.types import RouteRequest

__all__ = [
    "DEFAULT_TRACES",
    "KV_EVENT_LATENCY_S",
    "STORE_RTT_S",
    "VirtualGateway",
    "VirtualKVEvents",
    "VirtualLoadBoard",
    "VirtualLoadStore",
    "cluster_kv_tokens",
    "peak_rate",
    "replay",
    "run",
    "trace_token_ids",
]

DEFAULT_TRACES = (
    "mooncake_conversation_trace.jsonl",
    "AzureLLMInferenceTrace_code.csv",
    "AzureLLMInferenceTrace_conv.csv",
)
PRESET = "llama-3.1-70b-fp8-h200-tp4"
# The two 70B-on-H200 presets: TP8 has twice the GPUs, so about twice the KV cache per replica.
PRESETS = (PRESET, "llama-3.1-70b-fp8-h200-tp8")
MODEL = "llama-3.1-70b"
# The profiles whose choice depends on what the gateway remembers of earlier prompts.
CACHE_AWARE = ("tidal", "sglang_cache_aware", "llm_d")
SCRAPE_INTERVAL_S = 1.0  # the live gateway's default
QUICK_MIN, QUICK_MAX = 1000, 3000  # requests per trace in --quick
PEAK_WINDOW_S = 300.0

# What each policy's live system routes on, and the age of its stalest signal: llm-d's endpoint
# picker refreshes every replica's metrics every 50 ms (its --refresh-metrics-interval default);
# SGLang's router balances on its own in-flight counts; tidal reads the gateway's counts, the KV
# events and /metrics at the live gateway's scrape interval. The age is the policy's scrape
# interval where it reads /metrics (0: no scraped signal). Printed in each table's setup line.
SIGNALS: dict[str, tuple[float, str]] = {
    "tidal": (
        SCRAPE_INTERVAL_S,
        "gateway in-flight and prefill counts, KV events (5 ms), /metrics every 1 s",
    ),
    "round_robin": (0.0, "none"),
    "least_load": (0.0, "gateway in-flight counts"),
    "power_of_two": (0.0, "gateway in-flight counts"),
    "sglang_cache_aware": (0.0, "its own in-flight counts"),
    "llm_d": (0.05, "/metrics every 50 ms"),
}
# The policies that index the whole prompt (SGLang's character tree); the others read the live
# gateway's view, capped at 256 blocks of 64 characters as llm-d's prefix plugin is
# (:mod:`bench.prompt_views`).
FULL_VIEW = ("sglang_cache_aware",)

# The tuning budget, the same for every policy that has parameters: a 2 x 2 grid over its two
# main ones, its defaults first ("plugin.parameter", or "plugin@weight" for a scorer's weight in
# the profile). Tuned on one part of the trace at TUNE_LOAD, scored on another.
TUNING: dict[str, dict[str, tuple[float, float]]] = {
    "tidal": {"session-affinity-scorer@weight": (4.0, 0.0), "prefill-cost-scorer.affinity": (6.0, 3.0)},
    "sglang_cache_aware": {
        "cache-aware-scorer.cache_threshold": (0.3, 0.5),
        # Below the per-replica cap (16), so that the imbalance rule can engage at all.
        "cache-aware-scorer.balance_abs_threshold": (64.0, 8.0),
    },
    "llm_d": {"prefix-cache-scorer@weight": (3.0, 6.0), "queue-scorer@weight": (2.0, 4.0)},
}
TUNE_LOAD = 0.8
TUNE_SEEDS = 2
DEFAULT_SEEDS = 5
# Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (then the normal's).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)  # fmt: skip


def settings(policy: str) -> list[dict[str, float]]:
    """The tuning grid of ``policy`` (its defaults first); one empty setting if it has none."""
    grid = TUNING.get(policy)
    if not grid:
        return [{}]
    keys = list(grid)
    return [dict(zip(keys, values, strict=True)) for values in product(*(grid[k] for k in keys))]


def variant(policy: str, setting: Mapping[str, float]) -> tuple[str, dict[str, Any] | None]:
    """The profile to route with and the ``router:`` section that defines it: the built-in
    profile itself for an empty ``setting``, else a copy with the setting's parameters and
    weights (every plugin declared anew, so its indexes are its own)."""
    if not setting:
        return policy, None
    base = next(p for p in BUILTIN_ROUTER["profiles"] if p["name"] == policy)
    plugins, refs = [], []
    for ref in base["plugins"]:
        name = ref["ref"]
        params = {k.split(".", 1)[1]: v for k, v in setting.items() if k.startswith(f"{name}.")}
        plugins.append({"type": name, "name": name, "parameters": params})
        weight = setting.get(f"{name}@weight", ref.get("weight"))
        refs.append({"ref": name} if weight is None else {"ref": name, "weight": weight})
    tuned = f"{policy}-tuned"
    return tuned, {"plugins": plugins, "profiles": [{"name": tuned, "plugins": refs}]}


def mean_ci95(values: Sequence[float]) -> tuple[float, float, float]:
    """The mean of ``values`` and its 95 % interval (Student's t); a single value is its own."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return mean, mean, mean
    t = _T95[len(vals) - 2] if len(vals) - 1 <= len(_T95) else 1.96
    half = t * statistics.stdev(vals) / math.sqrt(len(vals))
    return mean, mean - half, mean + half


def verdict(mine: Sequence[float], others: Mapping[str, Sequence[float]]) -> str:
    """``best`` when ``mine``'s 95 % interval lies below that of the best other policy (by
    mean), ``behind`` when some other's lies below ``mine``'s, else ``tie``."""
    _, lo, hi = mean_ci95(mine)
    if not others:
        return "best"
    cis = {name: mean_ci95(v) for name, v in others.items()}
    nearest = min(cis.values(), key=lambda c: c[0])
    if hi < nearest[1]:
        return "best"
    if any(c[2] < lo for c in cis.values()):
        return "behind"
    return "tie"


def jittered(
    workload: Sequence[TraceRequest], views: Sequence[RouteView], seed: int
) -> tuple[list[TraceRequest], list[RouteView]]:
    """The trace's arrivals jittered for ``seed`` (seed 0: as recorded): each moved by up to half
    the trace's mean gap either way, the order re-sorted (views follow their requests)."""
    if seed == 0 or len(workload) < 2:
        return list(workload), list(views)
    gap = (workload[-1].arrival_s - workload[0].arrival_s) / (len(workload) - 1)
    rng = random.Random(seed)
    moved = [(max(0.0, r.arrival_s + rng.uniform(-gap / 2, gap / 2)), i) for i, r in enumerate(workload)]
    moved.sort()
    return [replace(workload[i], arrival_s=t) for t, i in moved], [views[i] for _, i in moved]


_TASKS: list[Callable[[], Any]] = []


def _call(i: int) -> Any:
    return _TASKS[i]()


def run_all(tasks: Sequence[Callable[[], Any]], jobs: int) -> list[Any]:
    """Every task's result, in order; on ``jobs`` forked processes when more than one (each
    replay is independent, and the children inherit the workloads instead of copying them)."""
    global _TASKS
    if jobs <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    _TASKS = list(tasks)
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=ctx) as pool:
            return list(pool.map(_call, range(len(tasks))))
    finally:
        _TASKS = []


class VirtualClock:
    """The :class:`~tidal.clock.Clock` of a virtual cluster: ``now()`` is its event time."""

    def __init__(self, cluster: VirtualCluster) -> None:
        self.cluster = cluster

    def now(self) -> float:
        return self.cluster.now

    async def sleep(self, seconds: float) -> None:
        raise RuntimeError("virtual time is advanced by the cluster's events, not by sleeping")


# -- the production sharing, in virtual time ---------------------------------------------------------

# Redis's round trip as the gateways measured it: another gateway's change is seen within two sync
# intervals plus two round trips, measured 0.03-0.12 s through three gateways (docs/gateway.md,
# "Several gateways"), so with the 50 ms interval the round trip is (0.12 - 2 x 0.05) / 2 = 10 ms.
STORE_RTT_S = 0.010
# A replica's KV events reach the gateways one engine step after the change (one batch per step,
# as vLLM publishes), then over ZMQ PUB/SUB on the private network, and are decoded: 5 ms, well
# inside the 100 ms the replay socket takes to answer (docs/kv_events.md).
KV_EVENT_LATENCY_S = 0.005
# A silent stream is proven current by a question to the replay socket every 0.25 s.
KV_PROBE_INTERVAL_S = 0.25
SHARING_MODES = ("shared", "unshared")
_U64 = 0xFFFF_FFFF_FFFF_FFFF


@dataclass
class _Published:
    visible_at: float
    published_at: float
    load: GatewayLoad


class VirtualLoadBoard:
    """What the Redis server holds for :class:`VirtualLoadStore` (see :mod:`router.redis_load`):
    every gateway's last published load, each replica's cap and its epoch, the counters' totals. A publication reaches
    the others' reads ``rtt_s`` after the sync that sent it (half a round trip to the server,
    half back with the reader's reply); a gateway's counts older than ``ttl_s`` are gone (the
    key expired). Cap proposals are a compare-and-set on the epoch, as the Lua script does."""

    def __init__(self, clock: VirtualClock, *, rtt_s: float = STORE_RTT_S, ttl_s: float = 2.0) -> None:
        self.clock = clock
        self.rtt_s = rtt_s
        self.ttl_s = ttl_s
        self.loads: dict[str, list[_Published]] = {}  # gateway -> publications, oldest first
        self.caps: dict[str, SharedCap] = {}
        self.counts: dict[str, int] = {}

    def sync(
        self,
        gateway_id: str,
        mine: GatewayLoad,
        proposals: Sequence[CapProposal],
        replicas: Sequence[str],
        increments: Mapping[str, int],
    ) -> SyncReply:
        now = self.clock.now()
        for name, n in increments.items():
            self.counts[name] = self.counts.get(name, 0) + n
        pubs = self.loads.setdefault(gateway_id, [])
        pubs.append(_Published(now + self.rtt_s, now, mine))
        accepted = []
        for p in proposals:
            cap = self.caps.get(p.replica)
            epoch = -1 if cap is None else cap.epoch
            if epoch in (-1, p.expected_epoch):
                self.caps[p.replica] = SharedCap(p.value, max(epoch, p.expected_epoch) + 1)
                accepted.append(p.replica)
        others: dict[str, GatewayLoad] = {}
        ages: dict[str, float] = {}
        for gid, history in self.loads.items():
            if gid == gateway_id:
                continue
            while len(history) > 1 and history[1].visible_at <= now:
                history.pop(0)  # superseded by a publication the reader can see
            seen = history[0]
            if seen.visible_at <= now and now - seen.published_at <= self.ttl_s:
                others[gid] = seen.load
                ages[gid] = now - seen.published_at
        caps = {name: c for name in replicas if (c := self.caps.get(name)) is not None}
        return SyncReply(others, ages, caps, frozenset(accepted), dict(self.counts))


class VirtualLoadStore:
    """:class:`~router.shared.LoadStore` on a :class:`VirtualLoadBoard`: Redis in virtual time."""

    def __init__(self, board: VirtualLoadBoard, gateway_id: str) -> None:
        self.board = board
        self.gateway_id = gateway_id
        self.last: GatewayLoad | None = None

    async def sync(
        self,
        mine: GatewayLoad,
        proposals: Sequence[CapProposal],
        replicas: Sequence[str],
        increments: Mapping[str, int] | None = None,
    ) -> SyncReply:
        self.last = mine
        return self.board.sync(self.gateway_id, mine, proposals, replicas, increments or {})

    async def leave(self) -> None:
        self.board.loads.pop(self.gateway_id, None)

    async def aclose(self) -> None:
        return None


def trace_token_ids(block_hashes: Sequence[int], block_size: int, length: int) -> list[int]:
    """Token ids standing in for a trace prompt's (a trace names blocks, not tokens): each full
    block's tokens are its hash, so equal blocks have equal tokens and the gateway's content keys
    (:func:`router.kv_events.chain_keys`) follow the trace's prefixes; the tail is zeros."""
    ids: list[int] = []
    for h in block_hashes:
        ids.extend([h & _U64] * block_size)
    ids.extend([0] * (length - len(ids)))
    return ids


def _with_trace_tokens(events: list[KVCacheEvent]) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The engine's events for trace requests carry no token ids; give them :func:`trace_token_ids`'."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for ev in events:
        assert isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared))
        if isinstance(ev, BlockStored) and not ev.token_ids and ev.block_hashes:
            bs = ev.block_size
            ids = [t for h in ev.block_hashes for t in [external_hash(h)] * bs]
            ev = msgspec.structs.replace(ev, token_ids=ids)
        out.append(ev)
    return out


def _trace_tokens(req: TraceRequest) -> list[int]:
    return trace_token_ids(block_hashes(req, 16), 16, req.input_length)


class VirtualKVEvents:
    """Every replica's KV event stream, delivered ``latency_s`` after the engine step that made it
    to one :class:`~router.kv_events.ReplicaBlockIndex` per replica, which every gateway reads
    (their subscriptions get the same stream with the same delay, so they hold the same index).
    A silent stream is proven current every ``probe_s``, as the subscriber's replay question does."""

    def __init__(
        self,
        cluster: VirtualCluster,
        *,
        latency_s: float = KV_EVENT_LATENCY_S,
        probe_s: float = KV_PROBE_INTERVAL_S,
    ) -> None:
        self.cluster = cluster
        self.latency_s = latency_s
        self.probe_s = probe_s
        self.indexes: list[ReplicaBlockIndex] = []
        self.in_transit = [0] * len(cluster.engines)
        for i, engine in enumerate(cluster.engines):
            index = ReplicaBlockIndex()
            index.reset(complete=True)  # followed since the cache was empty
            index.synced(0.0)
            self.indexes.append(index)
            engine.on_kv_events = partial(self._published, i)
        self._probing = False
        self.busy: Any = lambda: False  # whether any gateway has requests out (set by the replay)

    def _published(self, replica: int, events: list[KVCacheEvent]) -> None:
        at = self.cluster.now
        batch = KVEventBatch(ts=at, events=_with_trace_tokens(events))
        self.in_transit[replica] += 1
        self.cluster.at(at + self.latency_s, partial(self._deliver, replica, batch, at))

    def _deliver(self, replica: int, batch: KVEventBatch, sent: float, cluster: VirtualCluster) -> None:
        index = self.indexes[replica]
        index.apply(batch)
        index.synced(sent)
        self.in_transit[replica] -= 1

    def probe(self, cluster: VirtualCluster) -> None:
        """Prove the silent streams current; again in ``probe_s`` while a gateway is busy."""
        for i, index in enumerate(self.indexes):
            if self.in_transit[i] == 0:
                index.synced(cluster.now - self.latency_s)
        if self.busy():
            cluster.at(cluster.now + self.probe_s, self.probe)
        else:
            self._probing = False

    def start(self) -> None:
        if not self._probing:
            self._probing = True
            self.cluster.at(self.cluster.now, self.probe)


def bench_fleet(
    replicas: int,
    *,
    cap: int = 16,
    min_cap: int = 2,
    tpot_slo_s: float = 0.05,
    router: Mapping[str, Any] | None = None,
) -> FleetConfig:
    """The simulated pool as a fleet config: what the live gateway would load (``router``: its
    ``router:`` section, e.g. a tuned profile)."""
    return parse_fleet(
        {
            "models": [{"name": MODEL, "max_model_len": 131072}],
            "pools": {
                "interactive": {
                    "kind": "interactive",
                    "model": MODEL,
                    "max_inflight_per_replica": cap,
                    "min_inflight_per_replica": min_cap,
                    "replicas": [
                        {"name": f"sim-{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(replicas)
                    ],
                }
            },
            "classes": {"interactive": {"priority": 0, "wait_budget_s": 3600, "tpot_slo_s": tpot_slo_s}},
            "features": {"default": {"class": "interactive", "context_cap": 10_000_000}},
            "gateway": {"max_queue": 1_000_000, "scrape_interval_s": SCRAPE_INTERVAL_S},
            **({"router": dict(router)} if router else {}),
        },
        "routing benchmark",
    )


@dataclass
class _Inflight:
    req: TraceRequest
    arrival: float
    route: RouteRequest
    ticket: Ticket | None = None
    replica: ReplicaState | None = None
    prefilled: bool = False
    tenant: str = ""


@dataclass
class _Outcome:
    arrival: float
    result: SimResult
    tenant: str = ""


@dataclass
class VirtualGateway:
    """Registry + admission + router over a :class:`VirtualCluster`, driven by its events."""

    cluster: VirtualCluster
    fleet: FleetConfig
    profile: str
    seed: int = 0
    scrape_s: float = SCRAPE_INTERVAL_S  # how often this gateway reads the replicas' /metrics
    full_view: bool = False  # route on the whole prompt's blocks (RouteView.full), not the gateway's
    number: int = 0  # which of several gateways (request ids stay unique across them)
    store: VirtualLoadStore | None = None  # shared load state (router.shared), else this gateway's own
    kv: VirtualKVEvents | None = None  # the replicas' KV events, when they publish
    loop: asyncio.AbstractEventLoop | None = None  # runs the shared-state syncs (they do no I/O here)
    served: list[_Outcome] = field(default_factory=list)
    refused: int = 0
    follow_ups: int = 0  # requests of a session this gateway placed before
    stayed: int = 0  # ... placed where that session's previous request went
    notes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.clock = VirtualClock(self.cluster)
        self.registry = ReplicaRegistry.from_fleet(self.fleet, self.clock)
        self.states = self.registry.in_pool("interactive")
        self.index = {s.name: i for i, s in enumerate(self.states)}
        self.router = build_router(self.fleet.router, clock=self.clock, seed=self.seed)
        weights = {t.name: t.weight for t in self.fleet.tenants}
        self.admission = Admission(
            capacity=self.registry,
            clock=self.clock,
            max_queue=self.fleet.gateway.max_queue,
            policy=self.fleet.gateway.admission_policy,
            weight=lambda tenant: weights.get(tenant, 1.0),
            remote_inflight=self._remote_tenant_inflight,
            borrow_slots=self.fleet.gateway.fair_borrow_slots,
        )
        self.refused_by: Counter[str] = Counter()  # per tenant
        self.last_of_session: dict[str, str] = {}
        self.klass = self.fleet.classes["interactive"]
        self.outstanding = 0
        self._ids = 0
        self.shared: SharedLoad | None = None
        self._syncing = False
        self._phase = random.Random(self.seed * 7919 + self.number)
        if self.store is not None:
            gw = self.fleet.gateway
            self.shared = SharedLoad(
                self.registry,
                self.store,
                clock=self.clock,
                interval_s=gw.shared_state_interval_s,
                ttl_s=gw.shared_state_ttl_s,
                queue_depth=self.admission.queue_depth,
                tenant_load=lambda: self.admission.held,
                on_freed=self._freed,
            )
        if self.kv is not None:
            for state in self.states:
                state.kv_events = self.kv.indexes[self.index[state.name]]

    def _remote_tenant_inflight(self, pool: str, tenant: str) -> int:
        return self.shared.remote_tenants.get((pool, tenant), 0) if self.shared is not None else 0

    # -- the shared load state's sync loop, in virtual time -------------------------------------------

    def _sync(self, cluster: VirtualCluster) -> None:
        assert self.shared is not None and self.store is not None
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.shared.sync_once())
        last = self.store.last
        if self.outstanding > 0 or (last is not None and last.replicas):
            cluster.at(cluster.now + self.shared.interval_s, self._sync)
        else:
            self._syncing = False  # it published that it has nothing: quiet until the next arrival

    def _freed(self, pool: str) -> None:
        # Other gateways freed slots (or the shared cap grew): the queue may go on.
        for ticket in self.admission.wake(pool):
            self._dispatch(ticket.payload)

    # -- the gateway's background scrape, in virtual time --------------------------------------------

    def _scrape(self, cluster: VirtualCluster) -> None:
        for state in self.states:
            self.registry.update_snapshot(state.name, cluster.engines[self.index[state.name]].snapshot())
        if self.outstanding > 0:
            cluster.at(cluster.now + self.scrape_s, self._scrape)

    # -- one request ----------------------------------------------------------------------------------

    def arrive(self, req: TraceRequest, at: float, view: RouteView, tenant: str = "") -> None:
        """``req`` reaches this gateway at ``at``, read as ``view`` (:mod:`bench.prompt_views`)."""

        def on_arrival(cluster: VirtualCluster) -> None:
            if self.outstanding == 0:
                cluster.at(cluster.now, self._scrape)
            if self.shared is not None and not self._syncing:
                self._syncing = True
                # Gateways sync on their own clocks: a random phase within the interval.
                cluster.at(cluster.now + self._phase.uniform(0, self.shared.interval_s), self._sync)
            self.outstanding += 1
            if self.kv is not None:
                self.kv.start()
            route = RouteRequest(
                model=MODEL,
                prefix_key=view.prefix_key,
                prefix_blocks=tuple(view.full if self.full_view else view.live),
                session_key=view.session_key,
                prompt_tokens=view.prompt_tokens,
                engine_keys=None if self.kv is None else PromptKeys(partial(_trace_tokens, req)),
            )
            job = _Inflight(req, cluster.now, route, tenant=tenant)
            verdict, ticket = self.admission.offer(
                "interactive",
                "interactive",
                priority=self.klass.priority,
                wait_budget_s=self.klass.wait_budget_s,
                feature="default",
                regulated=False,
                payload=job,
                tenant=tenant,
            )
            job.ticket = ticket
            if verdict.decision is Decision.ADMIT:
                self._dispatch(job)
            elif verdict.decision is Decision.QUEUE:
                cluster.at(ticket.deadline, partial(self._expire_at, ticket))
            else:
                self._refuse(tenant)

        self.cluster.at(at, on_arrival)

    def _refuse(self, tenant: str = "") -> None:
        self.refused += 1
        self.refused_by[tenant] += 1
        self.outstanding -= 1

    def _expire_at(self, ticket: Ticket, cluster: VirtualCluster) -> None:
        # Only a ticket still queued is refused: one granted meanwhile has started (or finished).
        if ticket.state in ("waiting", "late") and self.admission.expire(ticket) is not None:
            self._refuse(ticket.tenant)

    def _dispatch(self, job: _Inflight) -> None:
        assert job.ticket is not None
        result = self.router.route(job.route, self.registry.views("interactive"), profile=self.profile)
        assert result is not None, "the benchmark's replicas are always routable"
        for key in ("prefix", "cache_aware"):
            if key in result.notes:
                name = f"{key}:{result.notes[key]}"
                self.notes[name] = self.notes.get(name, 0) + 1
        state = self.registry.get(result.replica.name)
        assert state is not None
        job.replica = state
        if (session := job.route.session_key) is not None:
            last = self.last_of_session.get(session)
            if last is not None:
                self.follow_ups += 1
                self.stayed += last == state.name
            self.last_of_session[session] = state.name
        self.registry.acquire(state, prompt_tokens=job.route.prompt_tokens)  # the estimate, as live
        self.admission.started(job.ticket)
        self._ids += 1
        self.cluster.submit(
            self.index[state.name],
            SimRequest(
                f"gw{self.number}-req-{self._ids}",
                max_tokens=job.req.output_length,
                block_hashes=block_hashes(job.req, 16),
                num_prompt_tokens=job.req.input_length,
                priority=self.klass.priority,
                on_first_token=partial(self._first_token, job),
                on_finish=partial(self._finished, job),
            ),
        )

    def _first_token(self, job: _Inflight, at: float) -> None:
        assert job.replica is not None
        job.prefilled = True
        self.registry.first_token(job.replica, job.route.prompt_tokens)

    def _finished(self, job: _Inflight, res: SimResult) -> None:
        assert job.replica is not None
        self.served.append(_Outcome(job.arrival, res, job.tenant))
        pending = 0 if job.prefilled else job.route.prompt_tokens
        self.registry.release(job.replica, tpot_s=res.tpot, pending_prompt_tokens=pending)
        self.admission.completed("interactive")
        assert job.ticket is not None
        self.admission.finished(job.ticket)
        self.outstanding -= 1
        for ticket in self.admission.wake("interactive"):
            self._dispatch(ticket.payload)


def replay(
    workload: Sequence[TraceRequest],
    policy: str,
    *,
    scale: float,
    views: Sequence[RouteView] | None = None,
    setting: Mapping[str, float] | None = None,
    replicas: int = 8,
    preset: str = PRESET,
    seed: int = 0,
    fleet: FleetConfig | None = None,
    warmup: float = 0.1,
    max_num_batched_tokens: int = 1024,
    gateways: int = 1,
    sharing: str = "shared",
    kv_events: bool = True,
) -> dict[str, Any]:
    """Replay ``workload`` with arrival times multiplied by ``scale`` (0: all at once) through the
    built-in profile ``policy`` with its parameters set as ``setting`` says (:func:`variant`);
    the measured figures of one run. ``views``: each request as the live routers read it
    (:func:`bench.prompt_views.prepare_views` of ``workload`` when not given); the policy's gateway
    scrapes /metrics as often as its live system does (:data:`SIGNALS`). Latencies leave out the requests that arrived
    in the first ``warmup`` share of the replay (while the caps converge from their start value).
    With ``gateways`` > 1, that many gateways share the replicas, and each request goes to one
    of them at random; with ``sharing`` ``"shared"`` they share load through the shared state
    (:mod:`router.shared`, on a :class:`VirtualLoadBoard` standing in for Redis), with
    ``"unshared"`` each keeps its own registry, caps, queue and router state. ``kv_events``: the
    replicas publish their KV events and every gateway follows them (:class:`VirtualKVEvents`)."""
    if sharing not in SHARING_MODES:
        raise ValueError(f"sharing must be one of {SHARING_MODES}, not {sharing!r}")
    cluster = VirtualCluster(
        preset,
        replicas,
        seed=seed,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_kv_cache_events=kv_events,
    )
    profile, router = variant(policy, setting or {})
    fleet = fleet or bench_fleet(replicas, router=router)
    if views is None:
        views = prepare_views(workload)
    kv = VirtualKVEvents(cluster) if kv_events else None
    board = (
        VirtualLoadBoard(VirtualClock(cluster), ttl_s=fleet.gateway.shared_state_ttl_s)
        if gateways > 1 and sharing == "shared"
        else None
    )
    loop = asyncio.new_event_loop() if board is not None else None
    gws = [
        VirtualGateway(
            cluster,
            fleet,
            profile,
            seed=seed + i,
            scrape_s=SIGNALS[policy][0] or SCRAPE_INTERVAL_S,  # policies on no scraped signal: the default
            full_view=policy in FULL_VIEW,
            number=i,
            store=VirtualLoadStore(board, f"gw{i}") if board is not None else None,
            kv=kv,
            loop=loop,
        )
        for i in range(gateways)
    ]
    if kv is not None:
        kv.busy = lambda: any(gw.outstanding for gw in gws)
    spread = random.Random(seed)  # an L4 balancer in front: any request to any gateway
    t0 = workload[0].arrival_s if workload else 0.0
    for req, view in zip(workload, views, strict=True):
        gw = gws[spread.randrange(gateways)] if gateways > 1 else gws[0]
        gw.arrive(req, (req.arrival_s - t0) * scale, view)
    wall = time.perf_counter()
    try:
        cluster.run()
    finally:
        if loop is not None:
            loop.close()
    wall = time.perf_counter() - wall
    served = [o for gw in gws for o in gw.served]
    horizon = max((o.arrival for o in served), default=0.0) * warmup
    steady = [o for o in served if o.arrival >= horizon]
    ttft = [o.result.first_token_time - o.arrival for o in steady if o.result.first_token_time is not None]
    tpot = [t for o in steady if (t := o.result.tpot) is not None]
    prompt = sum(o.result.num_prompt_tokens for o in served)
    cached = sum(o.result.num_cached_tokens for o in served)
    output = sum(o.result.num_output_tokens for o in served)
    work = [0.0] * replicas
    for o in served:
        r = o.result
        work[r.replica] += r.num_prompt_tokens - r.num_cached_tokens + r.num_output_tokens
    start = min((o.arrival for o in served), default=0.0)
    end = max((o.result.finish_time for o in served), default=0.0)
    mean_work = sum(work) / replicas if replicas else 0.0
    return {
        "served": len(served),
        "refused": sum(gw.refused for gw in gws),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p95_s": quantile(ttft, 0.95),
        "ttft_p99_s": quantile(ttft, 0.99),
        "tpot_p50_s": quantile(tpot, 0.5),
        "tpot_p95_s": quantile(tpot, 0.95),
        "prefix_hit_ratio": cached / prompt if prompt else 0.0,
        "throughput_tok_s": output / (end - start) if end > start else 0.0,
        "requests_per_s": len(served) / (end - start) if end > start else 0.0,
        "imbalance": max(work) / mean_work if mean_work else 1.0,
        "preemptions": sum(o.result.num_preemptions for o in served),
        "final_caps": [s.cap.value for s in gws[0].states],
        "ring_walk_share": sum(gw.notes.get("prefix:walked", 0) for gw in gws) / len(served)
        if served
        else 0.0,
        "session_share": sum(gw.follow_ups for gw in gws) / len(served) if served else 0.0,
        "session_stay": sum(gw.stayed for gw in gws) / max(1, sum(gw.follow_ups for gw in gws)),
        "wall_s": wall,
    }


def cluster_kv_tokens(replicas: int, preset: str = PRESET, max_num_batched_tokens: int = 1024) -> int:
    """Tokens of KV cache the whole simulated cluster holds (what :func:`replay` runs on)."""
    cluster = VirtualCluster(preset, 1, max_num_batched_tokens=max_num_batched_tokens)
    cfg = cluster.engines[0].config
    return replicas * cfg.num_gpu_blocks * cfg.preset.block_size


def peak_rate(workload: Sequence[TraceRequest], window_s: float = PEAK_WINDOW_S) -> float:
    """Arrivals per second in the busiest ``window_s`` of the workload (its mean rate when it is
    shorter than the window)."""
    times = sorted(r.arrival_s for r in workload)
    if len(times) < 2:
        return 0.0
    span = times[-1] - times[0]
    if span <= window_s:
        return len(times) / span if span > 0 else float("inf")
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window_s


def _workloads(trace: Any, quick: bool, limit: int | None) -> list[tuple[str, list[TraceRequest], str]]:
    files: list[str] = [trace] if isinstance(trace, str) else list(trace or [])
    out: list[tuple[str, list[TraceRequest], str]] = []
    if files:
        for f in files:
            if f == "synthetic":
                reqs = synthetic_workload(duration_s=3600.0)
                out.append(("synthetic", reqs, f"built-in synthetic workload ({len(reqs)} requests)"))
            else:
                out.append((Path(f).name, load_trace(f), f"trace file {Path(f).name}"))
    else:
        for name in DEFAULT_TRACES:
            found = find_trace(name, Path(__file__).resolve().parents[1])
            if found is not None:
                out.append((name, load_trace(found), f"real trace {name} (shared traces)"))
        if not out or not quick:
            reqs = synthetic_workload(duration_s=3600.0)
            why = "" if out else "; no trace found"
            out.append(("synthetic", reqs, f"built-in synthetic workload ({len(reqs)} requests{why})"))
    return [(name, reqs[:limit] if limit else reqs, src) for name, reqs, src in out]


def _fmt_ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1000:.0f}"


def _flag(value: str | bool, option: str) -> bool:
    text = str(value).lower()
    if text not in ("on", "off", "true", "false"):
        raise click.UsageError(f"--{option} must be 'on' or 'off', not {value!r}")
    return text in ("on", "true")


def run(
    quick: bool,
    out_dir: Path,
    trace: Any = None,
    loads: str | None = None,
    policies: str | None = None,
    replicas: str | int = 8,
    requests: str | int | None = None,
    seed: str | int = 0,
    seeds: str | int = DEFAULT_SEEDS,
    tune: str | bool = "on",
    jobs: str | int | None = None,
    load_basis: str = "peak",
    preset: str | None = None,
    gateways: str | int | None = None,
    kv_events: str | bool = "on",
    **_: Any,
) -> list[dict[str, Any]]:
    """Every preset x trace x load x policy, each over ``seeds`` seeds; rows as in the module
    docstring."""
    if load_basis not in ("peak", "mean"):
        raise click.UsageError(f"--load-basis must be 'peak' or 'mean', not {load_basis!r}")
    n_replicas = int(replicas)
    events = _flag(kv_events, "kv-events")
    opts = _Options(
        quick=quick,
        limit=int(requests) if requests is not None else None,
        loads=[float(x) for x in loads.split(",")] if loads else ([0.8] if quick else [0.5, 0.8, 0.95]),
        profiles=policies.split(",") if policies else list(BUILTIN_PROFILES),
        replicas=n_replicas,
        seeds=[int(seed) + k for k in range(max(1, int(seeds)))],
        tune=_flag(tune, "tune"),
        jobs=int(jobs) if jobs is not None else (os.cpu_count() or 1),
        load_basis=load_basis,
        gateway_counts=([] if quick else [2])
        if gateways is None
        else [n for n in (int(x) for x in str(gateways).split(",") if x.strip()) if n > 1],
        kv_events=events,
    )
    for p in opts.profiles:
        if p not in BUILTIN_PROFILES:
            raise click.UsageError(f"unknown policy {p!r} (known: {', '.join(BUILTIN_PROFILES)})")
    presets = preset.split(",") if preset else ([PRESET] if quick else list(PRESETS))
    for p in presets:
        get_preset(p)  # an unknown name fails before any replay
    rows: list[dict[str, Any]] = []
    for p in presets:
        for name, workload, source in _workloads(trace, quick, opts.limit):
            rows.extend(_run_trace(p, name, workload, source, opts))
    return rows


@dataclass(frozen=True)
class _Options:
    quick: bool
    limit: int | None
    loads: list[float]
    profiles: list[str]
    replicas: int
    seeds: list[int]
    tune: bool
    jobs: int
    load_basis: str
    gateway_counts: list[int]
    kv_events: bool


@dataclass(frozen=True)
class _Part:
    """A part of a trace (the tuning or the scored one), its views, capacity and load basis."""

    workload: list[TraceRequest]
    views: list[RouteView]
    capacity: float  # requests per second, saturated, round robin
    basis_rate: float  # arrivals per second the loads are taken of
    natural_rate: float
    busiest: float

    def scale(self, load: float) -> float:
        return self.basis_rate / (load * self.capacity) if self.capacity > 0 else 1.0


def _part(workload: list[TraceRequest], views: list[RouteView], preset: str, o: _Options) -> _Part:
    sat = replay(
        workload, "round_robin", scale=0.0, views=views, replicas=o.replicas, preset=preset, seed=o.seeds[0]
    )
    span = workload[-1].arrival_s - workload[0].arrival_s if len(workload) > 1 else 1.0
    natural = len(workload) / span if span > 0 else float("inf")
    busiest = peak_rate(workload)
    return _Part(
        workload,
        views,
        sat["requests_per_s"],
        busiest if o.load_basis == "peak" else natural,
        natural,
        busiest,
    )


def _replays(
    part: _Part,
    jobs: Sequence[tuple[float, str, Mapping[str, float], int, int, str]],
    preset: str,
    o: _Options,
) -> list[dict[str, Any]]:
    """One replay per (load, policy, setting, seed, gateways, sharing), on ``o.jobs`` processes."""
    by_seed = {s: jittered(part.workload, part.views, s) for s in {j[3] for j in jobs}}
    tasks = [
        partial(
            replay,
            by_seed[s][0],
            policy,
            views=by_seed[s][1],
            setting=setting,
            scale=part.scale(load),
            replicas=o.replicas,
            preset=preset,
            seed=s,
            gateways=gateways,
            sharing=sharing,
            kv_events=o.kv_events and sharing == "shared",
        )
        for load, policy, setting, s, gateways, sharing in jobs
    ]
    return run_all(tasks, o.jobs)


def _tune(part: _Part, preset: str, o: _Options) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Each tunable policy's setting with the lowest mean TTFT p95 on ``part`` at TUNE_LOAD
    (:data:`TUNE_SEEDS` seeds per setting), and every setting's figure."""
    grid = [(p, st) for p in o.profiles if p in TUNING for st in settings(p)]
    seeds = [o.seeds[0] + k for k in range(TUNE_SEEDS)]
    jobs = [(TUNE_LOAD, p, st, s, 1, "shared") for p, st in grid for s in seeds]
    results = _replays(part, jobs, preset, o)
    chosen: dict[str, dict[str, float]] = {}
    tried: dict[str, list[dict[str, Any]]] = {}
    for i, (policy, setting) in enumerate(grid):
        runs = results[i * len(seeds) : (i + 1) * len(seeds)]
        p95 = statistics.fmean(m["ttft_p95_s"] for m in runs)
        tried.setdefault(policy, []).append({"setting": setting, "ttft_p95_s": p95})
    for policy, options in tried.items():
        chosen[policy] = min(options, key=lambda x: x["ttft_p95_s"])["setting"]
    return chosen, tried


_MEAN_FIELDS = (
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p95_s",
    "prefix_hit_ratio",
    "throughput_tok_s",
    "imbalance",
    "preemptions",
    "ring_walk_share",
    "session_share",
    "session_stay",
)


def _run_trace(
    preset: str, name: str, workload: list[TraceRequest], source: str, o: _Options
) -> list[dict[str, Any]]:
    if o.quick and o.limit is None:
        # About four minutes of virtual time at 80% load: enough for the caps to settle.
        probe = replay(
            workload[:QUICK_MIN],
            "round_robin",
            scale=0.0,
            replicas=o.replicas,
            preset=preset,
            seed=o.seeds[0],
        )
        n = int(min(QUICK_MAX, max(QUICK_MIN, 240 * 0.8 * probe["requests_per_s"])))
        workload = workload[: 2 * n if o.tune else n]
    views = prepare_views(workload)  # over the whole trace: a conversation may span both parts
    tuning: _Part | None = None
    if o.tune and len(workload) >= 4:
        half = len(workload) // 2
        tuning = _part(workload[:half], views[:half], preset, o)
        workload, views = workload[half:], views[half:]
    scored = _part(workload, views, preset, o)
    click.echo(
        f"\n== {name}: {source}; {len(workload)} requests scored on {o.replicas} x {preset} (virtual time)"
    )
    ideal = ideal_hit_ratio(workload)
    kv_tokens = cluster_kv_tokens(o.replicas, preset)
    bound = capacity_hit_ratio(workload, kv_tokens)
    clairvoyant = belady_hit_ratio(workload, kv_tokens)
    click.echo(
        f"capacity (saturated, round robin, TPOT-capped): {scored.capacity:.2f} req/s; the trace's own "
        f"rate: {scored.natural_rate:.2f} req/s mean, {scored.busiest:.2f} in its busiest {PEAK_WINDOW_S:.0f} s "
        f"(peak / mean {scored.busiest / scored.natural_rate:.2f}); load basis: {o.load_basis}; "
        f"hit ratio bounds: ideal {ideal:.3f}, one LRU of the cluster's KV {bound:.3f} "
        f"(with clairvoyant eviction instead of LRU: {clairvoyant:.3f})"
    )
    click.echo("signals: " + "; ".join(f"{p}: {SIGNALS[p][1]}" for p in o.profiles))
    chosen: dict[str, dict[str, float]] = {}
    if tuning is not None:
        chosen, tried = _tune(tuning, preset, o)
        click.echo(
            f"tuned on the trace's first {len(tuning.workload)} requests at {TUNE_LOAD:.0%} load "
            f"({TUNE_SEEDS} seeds per setting; scored on the {len(workload)} after them):"
        )
        for policy, options in tried.items():
            figures = ", ".join(f"{_setting_text(x['setting'])} {x['ttft_p95_s']:.2f} s" for x in options)
            click.echo(f"  {policy}: chose {_setting_text(chosen[policy])} (TTFT p95: {figures})")
    combos: list[tuple[float, str, int, str]] = [
        (load, p, 1, "single") for load in o.loads for p in o.profiles
    ]
    if ideal > 0:
        # Several gateways: sharing the production state, and sharing nothing (what each
        # cache-aware policy loses without it).
        load = 0.8 if 0.8 in o.loads else o.loads[len(o.loads) // 2]
        for n in o.gateway_counts:
            combos += [(load, p, n, "shared") for p in o.profiles]
            combos += [(load, p, n, "unshared") for p in o.profiles if p in CACHE_AWARE]
    jobs = [
        (load, p, chosen.get(p, {}), s, n, "shared" if sharing == "single" else sharing)
        for load, p, n, sharing in combos
        for s in o.seeds
    ]
    results = _replays(scored, jobs, preset, o)
    k = len(o.seeds)
    rows: list[dict[str, Any]] = []
    for i, (load, policy, n, sharing) in enumerate(combos):
        runs = results[i * k : (i + 1) * k]
        rows.append(_row(preset, name, source, load, policy, n, sharing, runs, scored, o, chosen, tuning))
        rows[-1].update(ideal_hit_ratio=ideal, capacity_hit_ratio=bound, belady_hit_ratio=clairvoyant)
    _verdicts(rows)
    _print(rows, preset, name)
    return rows


def _setting_text(setting: Mapping[str, float]) -> str:
    return "defaults" if not setting else " ".join(f"{k}={v:g}" for k, v in setting.items())


def _row(
    preset: str,
    name: str,
    source: str,
    load: float,
    policy: str,
    gateways: int,
    sharing: str,
    runs: list[dict[str, Any]],
    part: _Part,
    o: _Options,
    chosen: Mapping[str, Mapping[str, float]],
    tuning: _Part | None,
) -> dict[str, Any]:
    p95 = [m["ttft_p95_s"] for m in runs]
    hit = [m["prefix_hit_ratio"] for m in runs]
    _, p95_lo, p95_hi = mean_ci95(p95)
    _, hit_lo, hit_hi = mean_ci95(hit)
    scale = part.scale(load)
    row: dict[str, Any] = {
        "preset": preset,
        "trace": name,
        "load": load,
        "policy": policy,
        "gateways": gateways,
        "sharing": sharing,
        "kv_events": o.kv_events and sharing != "unshared",
        **{f: statistics.fmean(m[f] for m in runs) for f in _MEAN_FIELDS},
        "seeds": len(runs),
        "ttft_p95_ci95_s": [p95_lo, p95_hi],
        "hit_ratio_ci95": [hit_lo, hit_hi],
        "ttft_p95_by_seed": p95,
        "signal_staleness_s": SIGNALS[policy][0],
        "signals": SIGNALS[policy][1],
        "tuned_params": dict(chosen.get(policy, {})) if policy in TUNING else {},
        "tuned_on": None if tuning is None else f"the {len(tuning.workload)} requests before the scored ones",
        "requests": runs[0]["served"],
        "refused": sum(m["refused"] for m in runs),
        "capacity_req_s": part.capacity,
        "load_basis": o.load_basis,
        "mean_load": part.natural_rate / scale / part.capacity if part.capacity > 0 else 0.0,
        "peak_load": part.busiest / scale / part.capacity if part.capacity > 0 else 0.0,
        "source": source,
        "sim_wall_s": round(sum(m["wall_s"] for m in runs), 2),
    }
    return row


def _verdicts(rows: list[dict[str, Any]]) -> None:
    """Each ``tidal`` row's ``verdict`` against the other policies of its load and gateways."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["load"], r["gateways"], r["sharing"]), []).append(r)
    for group in groups.values():
        for r in group:
            if r["policy"] == "tidal":
                others = {x["policy"]: x["ttft_p95_by_seed"] for x in group if x is not r}
                r["verdict"] = verdict(r["ttft_p95_by_seed"], others)


def _ci_ms(r: dict[str, Any]) -> str:
    lo, hi = r["ttft_p95_ci95_s"]
    if r["seeds"] < 2 or math.isnan(lo):
        return _fmt_ms(r["ttft_p95_s"])
    return f"{_fmt_ms(r['ttft_p95_s'])} ±{(hi - lo) / 2 * 1000:.0f}"


def _ci_hit(r: dict[str, Any]) -> str:
    lo, hi = r["hit_ratio_ci95"]
    if r["seeds"] < 2 or math.isnan(lo):
        return f"{r['prefix_hit_ratio']:.3f}"
    return f"{r['prefix_hit_ratio']:.3f} ±{(hi - lo) / 2:.3f}"


def _print(rows: list[dict[str, Any]], preset: str, trace: str) -> None:
    from tidal.cli.bench import print_table

    mine = [r for r in rows if r["trace"] == trace and r["preset"] == preset and r["gateways"] == 1]
    for load in sorted({r["load"] for r in mine}):
        at = [r for r in mine if r["load"] == load]
        rr = next((r for r in at if r["policy"] == "round_robin"), None)
        first = at[0]
        click.echo(
            f"\n{trace} at {load:.0%} load ({first['load_basis']} basis: {first['mean_load']:.0%} of capacity "
            f"by the mean rate, {first['peak_load']:.0%} in the busiest {PEAK_WINDOW_S:.0f} s; means of "
            f"{first['seeds']} seeds, ± the 95% interval's half-width; TTFT/TPOT in ms; x RR = TTFT p95 / "
            "round robin's; of_ideal = hit / the ideal's; verdict: tidal's TTFT p95 interval against the others')"
        )
        table = [
            {
                "policy": r["policy"],
                "ttft_p50": _fmt_ms(r["ttft_p50_s"]),
                "ttft_p95": _ci_ms(r),
                "ttft_p99": _fmt_ms(r["ttft_p99_s"]),
                "x_rr": f"{r['ttft_p95_s'] / rr['ttft_p95_s']:.2f}" if rr and rr["ttft_p95_s"] > 0 else "-",
                "tpot_p95": _fmt_ms(r["tpot_p95_s"]),
                "hit": _ci_hit(r),
                "of_ideal": f"{r['prefix_hit_ratio'] / r['ideal_hit_ratio']:.0%}"
                if r["ideal_hit_ratio"] > 0
                else "-",
                "tok_s": f"{r['throughput_tok_s']:.0f}",
                "imbalance": f"{r['imbalance']:.2f}",
                "verdict": r.get("verdict", ""),
            }
            for r in at
        ]
        print_table(table)
    many = [r for r in rows if r["trace"] == trace and r["preset"] == preset and r["gateways"] > 1]
    if many:
        one = {(r["load"], r["policy"]): r for r in mine}
        click.echo(
            f"\n{trace} through several gateways, each request to one at random ({many[0]['load']:.0%} load; "
            "sharing: shared = load through the shared state and KV events, unshared = each gateway on its "
            "own counts and estimates; vs_one = against one gateway; x RR = against one gateway's round robin)"
        )
        table = []
        for r in many:
            base = one.get((r["load"], r["policy"]))
            rr = one.get((r["load"], "round_robin"))
            table.append(
                {
                    "policy": r["policy"],
                    "gateways": r["gateways"],
                    "sharing": r["sharing"],
                    "ttft_p95": _ci_ms(r),
                    "x_rr": f"{r['ttft_p95_s'] / rr['ttft_p95_s']:.2f}"
                    if rr and rr["ttft_p95_s"] > 0
                    else "-",
                    "ttft_vs_one": f"{r['ttft_p95_s'] / base['ttft_p95_s']:.2f}" if base else "-",
                    "hit": _ci_hit(r),
                    "of_ideal": f"{r['prefix_hit_ratio'] / r['ideal_hit_ratio']:.0%}"
                    if r["ideal_hit_ratio"] > 0
                    else "-",
                    "hit_vs_one": f"{r['prefix_hit_ratio'] / base['prefix_hit_ratio'] - 1:+.1%}"
                    if base and base["prefix_hit_ratio"] > 0
                    else "-",
                    "tpot_p95": _fmt_ms(r["tpot_p95_s"]),
                    "verdict": r.get("verdict", ""),
                }
            )
        print_table(table)
