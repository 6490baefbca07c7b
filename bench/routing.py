"""``tidal bench routing``: every routing policy on the same trace, load and simulated fleet.

Replays a trace on 8 simulated replicas of each Llama-3.1-70B FP8 on H200 preset -- 4 x H200
(``llama-3.1-70b-fp8-h200-tp4``, 1.44 M tokens of KV per replica) and 8 x H200 (``-tp8``, 3.1 M)
-- in virtual time (``replicas.sim.virtual``) through a *virtual gateway* made of the product's own objects --
the replica registry, the admission controller with the adaptive per-replica caps, and the
router with each built-in profile -- with the same 1 s ``/metrics`` staleness the live gateway
has. Nothing here re-implements a policy: the profiles are :mod:`router.profiles`.

For each trace the capacity is measured first (requests per second the capped fleet completes
when saturated, round robin), then the trace's arrivals are rescaled to each load (50, 80, 95 %
of that capacity) and replayed once per policy. **Load** is the trace's offered rate over that
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
is the eviction policy, not the cluster's size) -- output throughput and
load imbalance (max / mean replica work). Requests carry the stable-prefix key of the
``prefix-ring`` as their first 2 512-token blocks (a conversation of the Mooncake trace, whose
first block is one global system prompt), for profiles that hash it.

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
a publication reaches the others' reads one round trip later (``STORE_RTT_S`` = 10 ms: the README's
measured staleness, 0.03-0.12 s through three gateways, is at most two intervals plus two round
trips), and the KV events above. The cache-aware profiles are also replayed through gateways that
share nothing (``sharing: unshared``, no KV events: each its own registry, in-flight counts, caps,
queue and router indexes), the loss without sharing: a conversation's turns then reach gateways
that never saw its earlier turns. Rows carry ``gateways``, ``sharing`` (``single`` for one
gateway) and ``kv_events``.

Traces: the Mooncake conversation trace and the Azure code trace from ``../shared/traces/``
(or ``$TIDAL_TRACES_DIR``), any ``--trace FILE`` (Mooncake JSONL or Azure CSV, repeatable), or
the built-in synthetic workload (``--trace synthetic``, and when no trace is found). Admission never refuses here (an hour-long
wait budget and an unbounded queue), so every policy serves every request and queueing shows in
TTFT.

Example::

    tidal bench routing --quick                     # TP4 only, one load, the first requests
    tidal bench routing --preset llama-3.1-70b-fp8-h200-tp8 --loads 0.8
    tidal bench routing --trace my_trace.jsonl --loads 0.5,0.9
    tidal bench routing --load-basis mean --policies tidal,round_robin
    tidal bench routing --trace synthetic --loads 0.8 --gateways 4
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import click
import msgspec

from bench.traces import (
    TraceRequest,
    belady_hit_ratio,
    block_hashes,
    capacity_hit_ratio,
    find_trace,
    ideal_hit_ratio,
    load_trace,
    synthetic_workload,
)
from priority.admission import Admission, Decision, Ticket
from priority.window import quantile
from replicas.sim.presets import get_preset
from replicas.sim.virtual import SimRequest, SimResult, VirtualCluster
from replicas.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    external_hash,
)
from router.kv_events import PromptKeys, ReplicaBlockIndex
from router.loader import build_router
from router.prefix import blocks_prefix_key
from router.profiles import BUILTIN_PROFILES
from router.registry import ReplicaRegistry, ReplicaState
from router.shared import CapProposal, GatewayLoad, SharedCap, SharedLoad, SyncReply
from router.types import RouteRequest
from tidal.fleet import FleetConfig, parse_fleet

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

DEFAULT_TRACES = ("mooncake_conversation_trace.jsonl", "AzureLLMInferenceTrace_code.csv")
PRESET = "llama-3.1-70b-fp8-h200-tp4"
# The two 70B-on-H200 presets: TP8 has twice the GPUs, so about twice the KV cache per replica.
PRESETS = (PRESET, "llama-3.1-70b-fp8-h200-tp8")
MODEL = "llama-3.1-70b"
DEFAULT_KEY_BLOCKS = 2
# The profiles whose choice depends on what the gateway remembers of earlier prompts.
CACHE_AWARE = ("tidal", "sglang_cache_aware", "llm_d")
SCRAPE_INTERVAL_S = 1.0
QUICK_MIN, QUICK_MAX = 1000, 3000  # requests per trace in --quick
PEAK_WINDOW_S = 300.0


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
# intervals plus two round trips, measured 0.03-0.12 s through three gateways (README, "Several
# gateways"), so with the 50 ms interval the round trip is (0.12 - 2 x 0.05) / 2 = 10 ms.
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
    every gateway's last published load, each replica's cap and its epoch. A publication reaches
    the others' reads ``rtt_s`` after the sync that sent it (half a round trip to the server,
    half back with the reader's reply); a gateway's counts older than ``ttl_s`` are gone (the
    key expired). Cap proposals are a compare-and-set on the epoch, as the Lua script does."""

    def __init__(self, clock: VirtualClock, *, rtt_s: float = STORE_RTT_S, ttl_s: float = 2.0) -> None:
        self.clock = clock
        self.rtt_s = rtt_s
        self.ttl_s = ttl_s
        self.loads: dict[str, list[_Published]] = {}  # gateway -> publications, oldest first
        self.caps: dict[str, SharedCap] = {}

    def sync(
        self, gateway_id: str, mine: GatewayLoad, proposals: Sequence[CapProposal], replicas: Sequence[str]
    ) -> SyncReply:
        now = self.clock.now()
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
        return SyncReply(others, ages, caps, frozenset(accepted))


class VirtualLoadStore:
    """:class:`~router.shared.LoadStore` on a :class:`VirtualLoadBoard`: Redis in virtual time."""

    def __init__(self, board: VirtualLoadBoard, gateway_id: str) -> None:
        self.board = board
        self.gateway_id = gateway_id
        self.last: GatewayLoad | None = None

    async def sync(
        self, mine: GatewayLoad, proposals: Sequence[CapProposal], replicas: Sequence[str]
    ) -> SyncReply:
        self.last = mine
        return self.board.sync(self.gateway_id, mine, proposals, replicas)

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


def bench_fleet(replicas: int, *, cap: int = 16, min_cap: int = 2, tpot_slo_s: float = 0.05) -> FleetConfig:
    """The simulated pool as a fleet config: what the live gateway would load."""
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
    key_blocks: int = DEFAULT_KEY_BLOCKS
    number: int = 0  # which of several gateways (request ids stay unique across them)
    store: VirtualLoadStore | None = None  # shared load state (router.shared), else this gateway's own
    kv: VirtualKVEvents | None = None  # the replicas' KV events, when they publish
    loop: asyncio.AbstractEventLoop | None = None  # runs the shared-state syncs (they do no I/O here)
    served: list[_Outcome] = field(default_factory=list)
    refused: int = 0
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
            cluster.at(cluster.now + SCRAPE_INTERVAL_S, self._scrape)

    # -- one request ----------------------------------------------------------------------------------

    def arrive(self, req: TraceRequest, at: float, tenant: str = "") -> None:
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
                prefix_key=blocks_prefix_key(req.hash_ids, self.key_blocks),
                prefix_blocks=req.hash_ids,
                block_tokens=req.block_tokens,
                prompt_tokens=req.input_length,
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
        self.registry.acquire(state, prompt_tokens=job.req.input_length)
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
        self.registry.first_token(job.replica, job.req.input_length)

    def _finished(self, job: _Inflight, res: SimResult) -> None:
        assert job.replica is not None
        self.served.append(_Outcome(job.arrival, res, job.tenant))
        pending = 0 if job.prefilled else job.req.input_length
        self.registry.release(job.replica, tpot_s=res.tpot, pending_prompt_tokens=pending)
        self.admission.completed("interactive")
        assert job.ticket is not None
        self.admission.finished(job.ticket)
        self.outstanding -= 1
        for ticket in self.admission.wake("interactive"):
            self._dispatch(ticket.payload)


def replay(
    workload: Sequence[TraceRequest],
    profile: str,
    *,
    scale: float,
    replicas: int = 8,
    preset: str = PRESET,
    key_blocks: int = DEFAULT_KEY_BLOCKS,
    seed: int = 0,
    fleet: FleetConfig | None = None,
    warmup: float = 0.1,
    max_num_batched_tokens: int = 1024,
    gateways: int = 1,
    sharing: str = "shared",
    kv_events: bool = True,
) -> dict[str, Any]:
    """Replay ``workload`` with arrival times multiplied by ``scale`` (0: all at once) through
    ``profile``; the measured figures of one run. Latencies leave out the requests that arrived
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
    fleet = fleet or bench_fleet(replicas)
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
            key_blocks=key_blocks,
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
    for req in workload:
        gw = gws[spread.randrange(gateways)] if gateways > 1 else gws[0]
        gw.arrive(req, (req.arrival_s - t0) * scale)
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
        if not out:
            reqs = synthetic_workload(duration_s=3600.0)
            out.append(
                ("synthetic", reqs, f"built-in synthetic workload ({len(reqs)} requests; no trace found)")
            )
    return [(name, reqs[:limit] if limit else reqs, src) for name, reqs, src in out]


def _fmt_ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1000:.0f}"


def run(
    quick: bool,
    out_dir: Path,
    trace: Any = None,
    loads: str | None = None,
    policies: str | None = None,
    replicas: str | int = 8,
    requests: str | int | None = None,
    seed: str | int = 0,
    load_basis: str = "peak",
    preset: str | None = None,
    gateways: str | int | None = None,
    kv_events: str | bool = "on",
    **_: Any,
) -> list[dict[str, Any]]:
    """Every preset x trace x load x policy; rows as in the module docstring."""
    if load_basis not in ("peak", "mean"):
        raise click.UsageError(f"--load-basis must be 'peak' or 'mean', not {load_basis!r}")
    n_replicas = int(replicas)
    if str(kv_events).lower() not in ("on", "off", "true", "false"):
        raise click.UsageError(f"--kv-events must be 'on' or 'off', not {kv_events!r}")
    events = str(kv_events).lower() in ("on", "true")
    load_levels = [float(x) for x in loads.split(",")] if loads else ([0.8] if quick else [0.5, 0.8, 0.95])
    profiles = policies.split(",") if policies else list(BUILTIN_PROFILES)
    limit = int(requests) if requests is not None else None
    presets = preset.split(",") if preset else ([PRESET] if quick else list(PRESETS))
    if gateways is None:
        gateway_counts = [] if quick else [2]
    else:
        gateway_counts = [n for n in (int(x) for x in str(gateways).split(",") if x.strip()) if n > 1]
    for p in presets:
        get_preset(p)  # an unknown name fails before any replay
    rows: list[dict[str, Any]] = []
    for p in presets:
        for name, workload, source in _workloads(trace, quick, limit):
            rows.extend(
                _run_trace(
                    p,
                    name,
                    workload,
                    source,
                    quick,
                    limit,
                    load_levels,
                    profiles,
                    n_replicas,
                    int(seed),
                    load_basis,
                    gateway_counts,
                    events,
                )
            )
    return rows


def _run_trace(
    preset: str,
    name: str,
    workload: list[TraceRequest],
    source: str,
    quick: bool,
    limit: int | None,
    load_levels: list[float],
    profiles: list[str],
    n_replicas: int,
    seed: int,
    load_basis: str,
    gateway_counts: list[int],
    kv_events: bool = True,
) -> list[dict[str, Any]]:
    if quick and limit is None:
        # About four minutes of virtual time at 80% load: enough for the caps to settle.
        probe = replay(
            workload[:QUICK_MIN], "round_robin", scale=0.0, replicas=n_replicas, preset=preset, seed=seed
        )
        n = int(min(QUICK_MAX, max(QUICK_MIN, 240 * 0.8 * probe["requests_per_s"])))
        workload = workload[:n]
    click.echo(f"\n== {name}: {source}; {len(workload)} requests on {n_replicas} x {preset} (virtual time)")
    ideal = ideal_hit_ratio(workload)
    kv_tokens = cluster_kv_tokens(n_replicas, preset)
    bound = capacity_hit_ratio(workload, kv_tokens)
    clairvoyant = belady_hit_ratio(workload, kv_tokens)
    span = workload[-1].arrival_s - workload[0].arrival_s if len(workload) > 1 else 1.0
    natural_rate = len(workload) / span if span > 0 else float("inf")
    busiest = peak_rate(workload)
    basis_rate = busiest if load_basis == "peak" else natural_rate
    sat = replay(workload, "round_robin", scale=0.0, replicas=n_replicas, preset=preset, seed=seed)
    capacity = sat["requests_per_s"]
    click.echo(
        f"capacity (saturated, round robin, TPOT-capped): {capacity:.2f} req/s; the trace's own "
        f"rate: {natural_rate:.2f} req/s mean, {busiest:.2f} in its busiest {PEAK_WINDOW_S:.0f} s "
        f"(peak / mean {busiest / natural_rate:.2f}); load basis: {load_basis}; "
        f"hit ratio bounds: ideal {ideal:.3f}, one LRU of the cluster's KV {bound:.3f} "
        f"(with clairvoyant eviction instead of LRU: {clairvoyant:.3f})"
    )

    def row(load: float, policy: str, gateways: int, sharing: str = "shared") -> dict[str, Any]:
        scale = basis_rate / (load * capacity) if capacity > 0 else 1.0
        m = replay(
            workload,
            policy,
            scale=scale,
            replicas=n_replicas,
            preset=preset,
            seed=seed,
            gateways=gateways,
            sharing=sharing,
            kv_events=kv_events and sharing == "shared",
        )
        return {
            "preset": preset,
            "trace": name,
            "load": load,
            "policy": policy,
            "gateways": gateways,
            "sharing": sharing if gateways > 1 else "single",
            "kv_events": kv_events and sharing == "shared",
            "ttft_p50_s": m["ttft_p50_s"],
            "ttft_p95_s": m["ttft_p95_s"],
            "ttft_p99_s": m["ttft_p99_s"],
            "tpot_p50_s": m["tpot_p50_s"],
            "tpot_p95_s": m["tpot_p95_s"],
            "prefix_hit_ratio": m["prefix_hit_ratio"],
            "ideal_hit_ratio": ideal,
            "capacity_hit_ratio": bound,
            "belady_hit_ratio": clairvoyant,
            "throughput_tok_s": m["throughput_tok_s"],
            "imbalance": m["imbalance"],
            "requests": m["served"],
            "refused": m["refused"],
            "preemptions": m["preemptions"],
            "ring_walk_share": m["ring_walk_share"],
            "capacity_req_s": capacity,
            "load_basis": load_basis,
            "mean_load": natural_rate / scale / capacity if capacity > 0 else 0.0,
            "peak_load": busiest / scale / capacity if capacity > 0 else 0.0,
            "source": source,
            "sim_wall_s": round(m["wall_s"], 2),
        }

    rows = [row(load, policy, 1) for load in load_levels for policy in profiles]
    if ideal > 0:
        # Several gateways that share no state: what each cache-aware policy loses to them.
        load = 0.8 if 0.8 in load_levels else load_levels[len(load_levels) // 2]
        for n in gateway_counts:
            rows += [row(load, policy, n) for policy in profiles]
            rows += [row(load, policy, n, "unshared") for policy in profiles if policy in CACHE_AWARE]
    _print(rows, preset, name)
    return rows


def _print(rows: list[dict[str, Any]], preset: str, trace: str) -> None:
    from tidal.cli.bench import print_table

    mine = [r for r in rows if r["trace"] == trace and r["preset"] == preset and r["gateways"] == 1]
    for load in sorted({r["load"] for r in mine}):
        at = [r for r in mine if r["load"] == load]
        rr = next((r for r in at if r["policy"] == "round_robin"), None)
        first = at[0]
        click.echo(
            f"\n{trace} at {load:.0%} load ({first['load_basis']} basis: {first['mean_load']:.0%} of capacity "
            f"by the mean rate, {first['peak_load']:.0%} in the busiest {PEAK_WINDOW_S:.0f} s; TTFT/TPOT in "
            "ms; x RR = TTFT p95 / round robin's; of_ideal, of_capacity = hit / its bound)"
        )
        table = [
            {
                "policy": r["policy"],
                "ttft_p50": _fmt_ms(r["ttft_p50_s"]),
                "ttft_p95": _fmt_ms(r["ttft_p95_s"]),
                "ttft_p99": _fmt_ms(r["ttft_p99_s"]),
                "x_rr": f"{r['ttft_p95_s'] / rr['ttft_p95_s']:.2f}" if rr and rr["ttft_p95_s"] > 0 else "-",
                "tpot_p50": _fmt_ms(r["tpot_p50_s"]),
                "tpot_p95": _fmt_ms(r["tpot_p95_s"]),
                "hit": f"{r['prefix_hit_ratio']:.3f}",
                "of_ideal": f"{r['prefix_hit_ratio'] / r['ideal_hit_ratio']:.0%}"
                if r["ideal_hit_ratio"] > 0
                else "-",
                "of_capacity": f"{r['prefix_hit_ratio'] / r['capacity_hit_ratio']:.0%}"
                if r["capacity_hit_ratio"] > 0
                else "-",
                "tok_s": f"{r['throughput_tok_s']:.0f}",
                "imbalance": f"{r['imbalance']:.2f}",
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
                    "ttft_p95": _fmt_ms(r["ttft_p95_s"]),
                    "x_rr": f"{r['ttft_p95_s'] / rr['ttft_p95_s']:.2f}"
                    if rr and rr["ttft_p95_s"] > 0
                    else "-",
                    "ttft_vs_one": f"{r['ttft_p95_s'] / base['ttft_p95_s']:.2f}" if base else "-",
                    "hit": f"{r['prefix_hit_ratio']:.3f}",
                    "of_ideal": f"{r['prefix_hit_ratio'] / r['ideal_hit_ratio']:.0%}",
                    "hit_vs_one": f"{r['prefix_hit_ratio'] / base['prefix_hit_ratio'] - 1:+.1%}"
                    if base and base["prefix_hit_ratio"] > 0
                    else "-",
                    "tpot_p95": _fmt_ms(r["tpot_p95_s"]),
                }
            )
        print_table(table)
