"""``tidal bench router-scale``: what one routing decision costs as the pool grows.

For pools of 8, 128, 512 and 2,048 replicas and every built-in profile it measures the median
and p99 time of one decision -- building the replica views (``registry.views``) plus
``router.route`` with the router's metrics as observer, as the proxy calls them -- and the
longest pause of Python's cyclic collector during a run of 20,000 decisions, with the routing
indexes at full size: each replica's ``kv-index`` (and the other profiles' prefix indexes) holds
a replica's KV capacity in blocks (``KVIndex.capacity``: 89,730 blocks of 16 tokens for the
routing benchmark's ``llama-3.1-70b-fp8-h200-tp4`` replica).

How, per pool size, in virtual time (a :class:`~tidal.clock.ManualClock`, 1 ms per decision):

* the product's objects: ``bench_fleet(n)``, ``ReplicaRegistry.from_fleet``, ``build_router``
  with :class:`~router.metrics.RouterMetrics` as observer (the router's series, which the
  gateway's metrics extend); every replica is "scraped" once per virtual second (a
  :class:`~replicas.metrics.LoadSnapshot` with the preset's KV size, its running requests and a
  KV usage), between decisions;
* requests built as the gateway builds them for chat: ``chat_prefix_key``, ``text_blocks`` of
  the rendered messages, the size estimate planned by ``plan_request``, a session key on half the
  conversations. Prompts average about 2,000 tokens: one of 8 shared system prompts, then
  conversations that grow turn by turn (a later turn repeats the earlier ones) and new ones;
* before timing, the indexes are filled (each distinct producer of the chosen profiles, through
  its own ``produce`` / ``after_pick``) with distinct old conversations spread over the previous
  10 virtual minutes, up to ``--fill`` blocks per replica (default: the capacity), or until the
  process's RSS reaches ``--max-rss-gb`` (16: the ``tidal`` profile's indexes fill 2,048
  replicas in about 12 GB; the anchors' per-block ones stop short): ``blocks_per_replica`` is
  the fill reached (in 16-token blocks), ``blocks_target`` the capacity;
* the gateway calls ``gc.freeze()`` once at start, before traffic fills its indexes, so they
  stay in the collector's sight; here too by default (``--freeze start``). ``--freeze filled``
  freezes after the fill instead, which hides them. After the fill one ``gc.collect()`` clears
  its garbage; pauses are timed with ``gc.callbacks`` over the measured decisions, and
  ``gc_full_ms`` is one full collection timed after the run (what any full collection costs at
  this size, whether or not one fell inside the run);
* load: each decision's pick is acquired with its prompt tokens; a request gets its first token
  once a quarter of the in-flight target later and ends at the target (half the pool's cap).

Rows: ``profile``, ``replicas``, ``decisions``, ``decision_p50_us``, ``decision_p99_us``,
``gc_pause_max_ms`` (the contract), plus ``vs_round_robin`` (p50 over round robin's, measured in
the same run; round robin is always run), ``gc_collections``, ``gc_full_collections``,
``gc_full_ms``, ``blocks_per_replica``, ``blocks_target``, ``indexes``, ``unrouted``, ``rss_gb``.
The ``tidal`` profile's targets are printed with PASS / MISS as measured.

Example::

    tidal bench router-scale --quick                 # 8 and 512 replicas, 2,000 decisions
    tidal bench router-scale --replicas 8,128 --profiles tidal,round_robin
    tidal bench router-scale --replicas 2048 --fill 20000 --max-rss-gb 12
"""

from __future__ import annotations

import functools
import gc
import importlib
import math
import os
import pickle
import random
import string
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click
from prometheus_client import CollectorRegistry

from tidal.bench.routing import PRESET, bench_fleet
from tidal.clock import ManualClock
from tidal.fleet import FleetConfig
from tidal.priority.features import estimate_tokens, plan_request
from tidal.priority.window import quantile
from tidal.replicas.metrics import LoadSnapshot
from tidal.replicas.sim.presets import get_preset
from tidal.router.framework import Producer, Router
from tidal.router.loader import build_router
from tidal.router.metrics import RouterMetrics
from tidal.router.plugins.producers.kv_index import KVIndex
from tidal.router.prefix import BLOCK_HASH_BITS, chat_prefix_key, render_messages, text_blocks
from tidal.router.profiles import BUILTIN_PROFILES
from tidal.router.registry import ReplicaRegistry, ReplicaState
from tidal.router.types import CycleState, RouteRequest

__all__ = ["run"]

T = TypeVar("T")

POOL = "interactive"
BASELINE = "round_robin"
DECISION_S = 0.001  # virtual time between decisions
SCRAPE_S = 1.0
FILL_SPAN_S = 600.0  # the fill stands for the previous 10 minutes of traffic
FILL_CALL_BLOCKS = 256  # one old conversation's blocks (text_blocks' maximum)
BLOCK_TOKENS = 16
WARMUP = 200
FEATURES = 8
QUICK_FILL = 5_000
SPREAD = 8  # replicas' fills differ by up to 1/SPREAD of the target


@dataclass
class _GCWatch:
    """Collector pauses seen through ``gc.callbacks``."""

    started: int = 0
    max_ns: int = 0
    by_generation: list[int] = field(default_factory=lambda: [0, 0, 0])

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter_ns()
            return
        self.max_ns = max(self.max_ns, time.perf_counter_ns() - self.started)
        self.by_generation[info["generation"]] += 1


def _rss_reader() -> Callable[[], int]:
    """The process's resident bytes: psutil when installed, else ``/proc/self/statm``."""
    try:
        proc = importlib.import_module("psutil").Process()
    except ImportError:
        page = os.sysconf("SC_PAGE_SIZE")

        def statm() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        return statm
    return lambda: int(proc.memory_info().rss)


def _requests(fleet: FleetConfig, count: int, seed: int) -> list[RouteRequest]:
    """Chat requests keyed as the gateway keys them: 8 shared system prompts, growing
    conversations (each turn repeats the earlier ones) and new ones; half carry a session."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(800)]

    def text(chars: int) -> str:
        return " ".join(rng.choices(words, k=max(1, chars // 6)))

    systems = [text(rng.randint(3_000, 5_000)) for _ in range(FEATURES)]
    model = fleet.pools[POOL].model
    active: list[tuple[list[dict[str, str]], str | None, int]] = []  # messages, session, turns left
    out: list[RouteRequest] = []
    for i in range(count):
        if not active or rng.random() < 0.35:
            messages = [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": text(rng.randint(1_000, 4_000))},
            ]
            active.append((messages, f"conv-{i}" if rng.random() < 0.5 else None, rng.randint(1, 6)))
            if len(active) > 256:
                active.pop(0)
            slot = len(active) - 1
        else:
            slot = rng.randrange(len(active))
            messages = active[slot][0]
            messages += [
                {"role": "assistant", "content": text(rng.randint(300, 1_200))},
                {"role": "user", "content": text(rng.randint(100, 600))},
            ]
        messages, session, left = active[slot]
        if left <= 1:
            active.pop(slot)
        else:
            active[slot] = (messages, session, left - 1)
        size = sum(len(m["content"].encode()) for m in messages)
        plan = plan_request(
            fleet, "default", model=model, prompt_tokens=estimate_tokens(size), max_tokens=None
        )
        out.append(
            RouteRequest(
                model=model,
                prefix_key=chat_prefix_key(messages),
                prefix_blocks=text_blocks(render_messages(messages)),
                session_key=session,
                prompt_tokens=plan.prompt_tokens,
                regions=plan.regions,
            )
        )
    return out


def _scrape(registry: ReplicaRegistry, states: list[ReplicaState], rng: random.Random) -> None:
    """What a ``/metrics`` scrape of each replica brings: its load and the engine's KV size."""
    preset = get_preset(PRESET)
    models = frozenset({preset.name})
    for s in states:
        usage = min(1.0, 0.55 + 0.025 * s.inflight + rng.uniform(-0.05, 0.05))
        snap = LoadSnapshot(
            num_running=float(s.inflight),
            num_waiting=float(rng.randint(0, 2)),
            kv_cache_usage=usage,
            block_size=preset.block_size,
            num_gpu_blocks=preset.num_gpu_blocks,
            model_names=models,
        )
        registry.update_snapshot(s.name, snap)


def _fill(
    producers: list[Producer],
    registry: ReplicaRegistry,
    clock: ManualClock,
    target: int,
    capacity: int,
    max_rss: int,
    rss: Callable[[], int],
    rng: random.Random,
) -> tuple[int, int, bool]:
    """Old conversations into every producer's indexes, round after round over the replicas,
    until each holds its share of ``target`` blocks or the RSS bound is reached; returns the mean
    and the least blocks a replica holds, and whether the RSS bound stopped it.

    The replicas' fills are spread (a live pool's replicas do not all hold the same history): a
    replica gets up to an eighth less than ``target`` below ``capacity``; at ``capacity``, up to
    an eighth more, which it evicts, so every index is full. Each round gives every replica the
    same share of its own fill, so wherever the RSS bound stops it the replicas stay as spread.
    Filled alike, every replica of a large pool reached the same growth point of its dicts and
    arrays together, and the first decisions after the fill all paid it (a tenth of the
    decisions at 2,048 replicas); a fill stopped after equal rounds did the same."""
    if not producers or target <= 0:
        return 0, 0, False
    views = registry.views(POOL)
    model = views[0].model
    spread = [int(rng.random() * target / SPREAD) for _ in views]
    wants = [target + s if target >= capacity else target - s for s in spread]
    got = [0] * len(views)
    rounds = math.ceil(max(wants) / FILL_CALL_BLOCKS)

    def held(stopped: bool) -> tuple[int, int, bool]:
        resident = [min(g, capacity) for g in got]
        return sum(resident) // len(resident), min(resident), stopped

    for r in range(rounds):
        for j, view in enumerate(views):
            k = min(FILL_CALL_BLOCKS, -(-wants[j] * (r + 1) // rounds) - got[j])
            if k <= 0:
                continue
            if j % 64 == 0 and rss() >= max_rss:
                return held(True)
            request = RouteRequest(
                model=model,
                prefix_key=rng.getrandbits(64),
                prefix_blocks=tuple(rng.getrandbits(BLOCK_HASH_BITS) for _ in range(k)),
                session_key=f"fill-{r}-{j}" if j % 2 else None,
                prompt_tokens=k * BLOCK_TOKENS,
            )
            state = CycleState(request, clock.now(), random.Random(0))
            for p in producers:
                p.produce(request, views, [view], state)
                p.after_pick(request, view, state)
            got[j] += k
        clock.advance(FILL_SPAN_S / rounds)
    return held(False)


def _measure(
    router: Router,
    profile: str,
    registry: ReplicaRegistry,
    clock: ManualClock,
    requests: list[RouteRequest],
    inflight_target: int,
    rng: random.Random,
) -> dict[str, Any]:
    """Warm-up, then the timed decisions; the pool kept at ``inflight_target`` requests."""
    states = registry.in_pool(POOL)
    prefilling: deque[tuple[ReplicaState, int]] = deque()
    running: deque[ReplicaState] = deque()
    watch = _GCWatch()
    samples: list[int] = []
    unrouted = 0
    next_scrape = clock.now()
    try:
        for i, request in enumerate(requests):
            if i == WARMUP:
                gc.callbacks.append(watch)
            clock.advance(DECISION_S)
            if clock.now() >= next_scrape:
                _scrape(registry, states, rng)
                next_scrape += SCRAPE_S
            t0 = time.perf_counter_ns()
            views = registry.views(POOL)
            result = router.route(request, views, profile=profile)
            elapsed = time.perf_counter_ns() - t0
            if i >= WARMUP:
                samples.append(elapsed)
            if result is None:
                unrouted += 1
                continue
            state = registry.get(result.replica.name)
            assert state is not None
            registry.acquire(state, None, request.prompt_tokens)
            prefilling.append((state, request.prompt_tokens))
            while len(prefilling) > max(1, inflight_target // 4):
                s, tokens = prefilling.popleft()
                registry.first_token(s, tokens)
                running.append(s)
            while running and len(prefilling) + len(running) > inflight_target:
                registry.release(running.popleft(), tpot_s=0.03)
    finally:
        if watch in gc.callbacks:
            gc.callbacks.remove(watch)
    for s, tokens in prefilling:  # the next profile starts on an idle pool
        registry.release(s, tpot_s=0.03, pending_prompt_tokens=tokens)
    for s in running:
        registry.release(s, tpot_s=0.03)
    t0 = time.perf_counter_ns()
    gc.collect()
    full_ns = time.perf_counter_ns() - t0
    us = [x / 1e3 for x in samples]
    return {
        "decision_p50_us": quantile(us, 0.5),
        "decision_p99_us": quantile(us, 0.99),
        "decision_max_us": max(us, default=math.nan),
        "gc_pause_max_ms": watch.max_ns / 1e6,
        "gc_collections": sum(watch.by_generation),
        "gc_full_collections": watch.by_generation[2],
        "gc_full_ms": full_ns / 1e6,
        "unrouted": unrouted,
    }


def _pool(
    n: int,
    profiles: list[str],
    count: int,
    fill: int | None,
    max_rss: int,
    freeze: str,
    seed: int,
    isolate: bool,
) -> list[dict[str, Any]]:
    """Every profile on a pool of ``n`` replicas: each on its own pool, with only its own indexes
    filled (a gateway fills the indexes of the profiles its traffic uses), in a child process of
    its own when ``isolate`` (what one profile leaves in memory never weighs on the next)."""
    rows = []
    for name in profiles:
        job = functools.partial(_profile, n, name, count, fill, max_rss, freeze, seed)
        rows.append(_in_child(job) if isolate else job())
    base = next(r["decision_p50_us"] for r in rows if r["profile"] == BASELINE)
    for r in rows:
        r["vs_round_robin"] = r["decision_p50_us"] / base if base > 0 else math.nan
    return rows


def _profile(
    n: int,
    profile: str,
    count: int,
    fill: int | None,
    max_rss: int,
    freeze: str,
    seed: int,
) -> dict[str, Any]:
    """One profile on a pool of ``n`` replicas, its indexes filled first, over ``count`` requests
    built here: read in a forked child, requests built before the fork cost a copy-on-write page
    fault at every first touch (a third of a decision at 8 replicas)."""
    requests = _requests(bench_fleet(1), count, seed)
    rss = _rss_reader()
    gc.collect()
    clock = ManualClock()
    fleet = bench_fleet(n)
    registry = ReplicaRegistry.from_fleet(fleet, clock)
    metrics = RouterMetrics(CollectorRegistry())
    router = build_router(fleet.router, clock=clock, seed=seed, observer=metrics)
    rng = random.Random(seed)
    _scrape(registry, registry.in_pool(POOL), rng)
    kv_index = next((p for p in router.producers() if isinstance(p, KVIndex)), KVIndex())
    capacity = kv_index.capacity(registry.views(POOL)[0], BLOCK_TOKENS)
    target = capacity if fill is None else fill
    producers = router.producers([profile])
    indexes = ",".join(p.TYPE for p in producers)
    if freeze == "start":
        gc.freeze()  # as the gateway at start: what fills the indexes later stays in sight
    try:
        t0 = time.perf_counter()
        mean, least, stopped = _fill(producers, registry, clock, target, capacity, max_rss, rss, rng)
        gc.collect()
        if freeze == "filled":
            gc.freeze()
        if producers:
            click.echo(
                f"{n} replicas, {profile}: indexes ({indexes}) filled to {mean:,} blocks per replica "
                f"(least {least:,}; target {target:,}){' (stopped at --max-rss-gb)' if stopped else ''} in {time.perf_counter() - t0:.1f} s; "
                f"RSS {rss() / 2**30:.2f} GB"
            )
        cap = fleet.pools[POOL].max_inflight_per_replica
        measured = _measure(router, profile, registry, clock, requests, n * cap // 2, rng)
        return {
            "profile": profile,
            "replicas": n,
            "decisions": len(requests) - WARMUP,
            **measured,
            "blocks_per_replica": mean,
            "blocks_min": least,
            "blocks_target": capacity,
            "indexes": indexes,
            "freeze": freeze,
            "rss_gb": rss() / 2**30,
        }
    finally:
        gc.unfreeze()


def _in_child(job: Callable[[], T]) -> T:
    """``job()`` in a forked child process; its result (pickled back), or its error raised here.
    Where there is no ``fork``, here."""
    if not hasattr(os, "fork"):
        return job()
    sys.stdout.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 0
        try:
            try:
                payload = pickle.dumps((True, job()))
            except BaseException:  # reported to the parent, which raises it
                payload = pickle.dumps((False, traceback.format_exc()))
                code = 1
            sys.stdout.flush()
            with os.fdopen(write, "wb") as out:
                out.write(payload)
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as inp:
        payload = inp.read()
    os.waitpid(pid, 0)
    if not payload:
        raise RuntimeError("the benchmark's child process died without a result")
    ok, value = pickle.loads(payload)
    if not ok:
        raise RuntimeError(f"the benchmark's child process failed:\n{value}")
    return value  # type: ignore[no-any-return]


def _targets(rows: list[dict[str, Any]], decisions: int) -> None:
    """The ``tidal`` profile's targets, PASS or MISS as measured (or not measured)."""
    tidal = {r["replicas"]: r for r in rows if r["profile"] == "tidal"}

    def line(what: str, replicas: int, column: str, bound: float, unit: str, scale: float = 1.0) -> None:
        r = tidal.get(replicas)
        if r is None:
            click.echo(f"  {what} at {replicas} replicas <= {bound:g} {unit}: not measured")
            return
        value = r[column] * scale
        verdict = "PASS" if value <= bound else "MISS"
        click.echo(f"  {what} at {replicas} replicas <= {bound:g} {unit}: {value:.4g} {unit}  {verdict}")

    click.echo("\ntargets, tidal profile:")
    line("median decision", 8, "decision_p50_us", 100, "us")
    line("median decision", 2048, "decision_p50_us", 300, "us")
    line("p99 decision", 2048, "decision_p99_us", 1, "ms", 1e-3)
    for n in sorted(tidal):
        line("longest collector pause", n, "gc_pause_max_ms", 20, "ms")
    partial = [r for r in tidal.values() if r["blocks_per_replica"] < r["blocks_target"]]
    if partial or decisions < 20_000:
        click.echo(
            "  note: the targets are for 20,000 decisions with indexes at full size; this run had "
            f"{decisions:,} decisions"
            + "".join(
                f", {r['blocks_per_replica']:,} of {r['blocks_target']:,} blocks at {r['replicas']} replicas"
                for r in partial
            )
        )


def run(
    quick: bool,
    out_dir: Path,
    replicas: str | int | None = None,
    profiles: str | None = None,
    decisions: str | int | None = None,
    fill: str | int | None = None,
    max_rss_gb: str | float = 16.0,
    freeze: str = "start",
    seed: str | int = 0,
    isolate: str | bool = True,
    **_: Any,
) -> list[dict[str, Any]]:
    """Rows per pool size x profile, as in the module docstring."""
    if freeze not in ("start", "filled"):
        raise click.UsageError(f"--freeze must be 'start' or 'filled', not {freeze!r}")
    sizes = (
        [int(x) for x in str(replicas).split(",")]
        if replicas
        else ([8, 512] if quick else [8, 128, 512, 2048])
    )
    chosen = profiles.split(",") if profiles else list(BUILTIN_PROFILES)
    unknown = [p for p in chosen if p not in BUILTIN_PROFILES]
    if unknown:
        raise click.UsageError(
            f"unknown profile(s) {', '.join(unknown)} (known: {', '.join(BUILTIN_PROFILES)})"
        )
    if BASELINE not in chosen:
        chosen.append(BASELINE)  # the baseline of vs_round_robin
    n_decisions = int(decisions) if decisions is not None else (2_000 if quick else 20_000)
    blocks = int(fill) if fill is not None else (QUICK_FILL if quick else None)
    seed = int(seed)
    alone = str(isolate).lower() not in ("0", "false", "no", "off")
    t0 = time.perf_counter()
    requests = _requests(bench_fleet(1), WARMUP + n_decisions, seed)
    mean_tokens = sum(r.prompt_tokens for r in requests) / len(requests)
    click.echo(
        f"{len(requests):,} chat requests ({WARMUP} warm-up), {mean_tokens:.0f} prompt tokens on average, "
        f"built in {time.perf_counter() - t0:.1f} s (and again for each run)"
    )
    count = len(requests)
    del requests  # (each run builds its own)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        rows += _pool(n, chosen, count, blocks, int(float(max_rss_gb) * 2**30), freeze, seed, alone)
    from tidal.cli.bench import print_table

    print_table(
        rows,
        [
            "profile",
            "replicas",
            "decisions",
            "decision_p50_us",
            "decision_p99_us",
            "vs_round_robin",
            "gc_pause_max_ms",
            "gc_collections",
            "gc_full_ms",
            "blocks_per_replica",
            "blocks_min",
            "blocks_target",
            "unrouted",
        ],
    )
    _targets(rows, n_decisions)
    return rows
