"""The simulated engine: scheduler + KV cache + cost model + vLLM's metrics, on any clock.

The engine never reads a clock itself; its caller says what time it is. One step is
``begin_step(now)`` (schedule; the step's modelled duration is ``out.duration``) and, when that
time has passed, ``end_step(out, now)`` (sample tokens, finish requests, record metrics). The
HTTP server drives it in real time, ``replicas.sim.virtual`` in virtual time, where runs of
identical decode steps are applied in closed form (``steady_*``).

Its load is reported as :class:`replicas.metrics.LoadSnapshot` (``snapshot()``) and as a vLLM
``/metrics`` page (``render_metrics()``) whose families, types and labels are vLLM's;
``parse_load_snapshot(engine.render_metrics()) == engine.snapshot()`` holds.

Example::

    engine = SimEngine("llama-3.1-8b-h100", seed=0)
    engine.add_request(engine.make_request("r1", prompt_token_ids=ids, max_tokens=64), now=0.0)
    out = engine.begin_step(0.0)
    produced, finished = engine.end_step(out, 0.0 + out.duration)
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric

from tidal.replicas.metrics import LoadSnapshot
from tidal.replicas.sim.block_pool import BlockPool
from tidal.replicas.sim.kv_cache_manager import KVCacheManager
from tidal.replicas.sim.presets import Preset, get_preset
from tidal.replicas.sim.request import Request, RequestStatus
from tidal.replicas.sim.scheduler import Policy, Scheduler, SchedulerConfig, SchedulerOutput
from tidal.replicas.wire.kv_events import BlockHasher, KVCacheEvent
from tidal.replicas.wire.prom import Histogram, counter_family, gauge_family, histogram_family

__all__ = ["EngineConfig", "LoRAAdapter", "SimEngine", "StepOutput"]

# vLLM 0.33's bucket lists (vllm/v1/metrics/loggers.py, buckets.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_MAX_LORA_INFO_SERIES = 256  # vLLM keeps every label set ever seen; we keep the latest 256


def _buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exp += 1


@dataclass(frozen=True)
class EngineConfig:
    """A preset plus this replica's overrides (the ``tidal sim`` flags)."""

    preset: Preset
    served_model_name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_loras: int
    num_gpu_blocks: int
    policy: Policy = "priority"
    enable_prefix_caching: bool = True
    check_invariants: bool = False
    engine_index: int = 0
    enable_kv_cache_events: bool = False
    prefix_caching_hash_algo: str = "sha256"

    @property
    def block_size(self) -> int:
        return self.preset.block_size

    @classmethod
    def from_preset(
        cls,
        preset: Preset | str,
        *,
        served_model_name: str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        max_loras: int | None = None,
        num_gpu_blocks: int | None = None,
        policy: Policy = "priority",
        enable_prefix_caching: bool = True,
        check_invariants: bool = False,
        engine_index: int = 0,
        enable_kv_cache_events: bool = False,
        prefix_caching_hash_algo: str = "sha256",
    ) -> EngineConfig:
        p = get_preset(preset) if isinstance(preset, str) else preset
        mnbt = max_num_batched_tokens or p.max_num_batched_tokens
        if num_gpu_blocks is None:
            p2 = p if mnbt == p.max_num_batched_tokens else replace(p, max_num_batched_tokens=mnbt)
            num_gpu_blocks = p2.num_gpu_blocks
        mml = max_model_len or p.context_len
        # Like vLLM, refuse a context length the KV cache cannot hold for one request.
        capacity = (num_gpu_blocks - 1) * p.block_size
        if mml > capacity:
            raise ValueError(
                f"max_model_len {mml} does not fit in the KV cache ({capacity} tokens); "
                "lower --max-model-len or give more blocks"
            )
        return cls(
            preset=p,
            served_model_name=served_model_name or p.name,
            max_num_seqs=max_num_seqs or p.max_num_seqs,
            max_num_batched_tokens=mnbt,
            max_model_len=mml,
            max_loras=p.max_loras if max_loras is None else max_loras,
            num_gpu_blocks=num_gpu_blocks,
            policy=policy,
            enable_prefix_caching=enable_prefix_caching,
            check_invariants=check_invariants,
            engine_index=engine_index,
            enable_kv_cache_events=enable_kv_cache_events,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
        )


@dataclass
class LoRAAdapter:
    name: str
    lora_id: int
    path: str  # recorded only: the simulator never reads it


@dataclass
class StepOutput:
    """One scheduled step: the scheduler's output and the step's modelled duration."""

    sched: SchedulerOutput
    begin: float
    duration: float
    flops: float
    read_bytes: float
    write_bytes: float


class _Counters:
    """vLLM's counters and histograms for one engine."""

    def __init__(self, max_model_len: int) -> None:
        self.prompt_tokens = 0
        self.prompt_tokens_local_compute = 0
        self.prompt_tokens_local_cache_hit = 0
        self.generation_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.flops = 0.0
        self.read_bytes = 0.0
        self.write_bytes = 0.0
        b125 = _buckets_1_2_5(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_len = Histogram(b125)
        self.gen_len = Histogram(b125)
        self.max_gen = Histogram(b125)
        self.max_tokens_param = Histogram(b125)
        self.prefill_kv_computed = Histogram(b125)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.params_n = Histogram(PARAMS_N_BUCKETS)
        self.num_preemptions_hist = Histogram(PREEMPTION_BUCKETS)


def _default_token_source(seed: int, vocab: int) -> Callable[[Request], int]:
    def next_token(r: Request) -> int:
        base = r.block_hashes[0] if r.block_hashes else r.num_prompt_tokens
        return hash((seed, base, r.num_output_tokens)) % vocab

    return next_token


class SimEngine:
    """One simulated vLLM replica's engine (no HTTP, no clock of its own).

    **Parameters:** ``preset`` (name or :class:`Preset`), ``seed`` (generated text and natural
    stop lengths), ``token_source`` (next output token of a token-mode request; default: a hash
    of the seed, the prompt and the position), ``wall_clock`` (the value of
    ``vllm:lora_requests_info``; default ``time.time``), and the :class:`EngineConfig`
    overrides (``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``max_loras``,
    ``num_gpu_blocks``, ``policy``, ``enable_prefix_caching``, ``check_invariants``, ...).
    """

    def __init__(
        self,
        preset: Preset | str = "llama-3.1-8b-h100",
        *,
        seed: int = 0,
        token_source: Callable[[Request], int] | None = None,
        wall_clock: Callable[[], float] | None = None,
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.config = config or EngineConfig.from_preset(preset, **overrides)
        cfg = self.config
        self.preset = cfg.preset
        self.cost = self.preset.cost
        self.seed = seed
        self.block_size = cfg.block_size
        events = cfg.enable_kv_cache_events and cfg.enable_prefix_caching
        self.block_pool = BlockPool(
            cfg.num_gpu_blocks, enable_caching=cfg.enable_prefix_caching, enable_kv_cache_events=events
        )
        self.kv_cache_manager = KVCacheManager(
            self.block_pool,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            enable_caching=cfg.enable_prefix_caching,
            hasher=BlockHasher(cfg.prefix_caching_hash_algo) if events else None,
        )
        # Gets each step's KV events (``enable_kv_cache_events``): the server's publisher, or an
        # in-process index in virtual time.
        self.on_kv_events: Callable[[list[KVCacheEvent]], object] | None = None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
                policy=cfg.policy,
                max_loras=cfg.max_loras,
                check_invariants=cfg.check_invariants,
            ),
            self.kv_cache_manager,
            token_source=token_source or _default_token_source(seed, self.preset.model.vocab_size),
        )
        self.wall_clock = wall_clock or time.time
        self.counters = _Counters(cfg.max_model_len)
        self.loras: dict[str, LoRAAdapter] = {}
        self._next_lora_id = 1
        self._lora_info: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.created = self.wall_clock()
        # The engine's own registry (``render_metrics``); the server adds it to its page's.
        self.metrics_registry = CollectorRegistry()
        self.metrics_registry.register(self)
        self.num_steps = 0
        self.busy_seconds = 0.0
        # Requests refused by an admission limit of the server (vllm:admission_rejections).
        self.admission_rejections: dict[str, int] = {}

    # -- requests ------------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        *,
        max_tokens: int,
        prompt_token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[int] | None = None,
        num_prompt_tokens: int | None = None,
        priority: int = 0,
        lora: str | None = None,
        stop_after: int | None = None,
        output_salt: int | None = None,
    ) -> Request:
        """A request for this engine; ``max_tokens`` is capped by the context length, as vLLM does.

        Raises ``ValueError`` for a prompt longer than the context and ``KeyError`` for an
        adapter that is not loaded.
        """
        n = len(prompt_token_ids) if prompt_token_ids is not None else num_prompt_tokens
        if n is None:
            raise ValueError("give prompt_token_ids, or block_hashes with num_prompt_tokens")
        mml = self.config.max_model_len
        if n > mml:
            raise ValueError(f"prompt of {n} tokens exceeds the context length {mml}")
        pooling = self.preset.is_embedding
        lora_id = 0
        hash_extra: tuple[tuple[str, ...], ...] | None = None
        if lora is not None:
            adapter = self.loras[lora]
            lora_id = adapter.lora_id
            hash_extra = (("lora", adapter.name, adapter.path),)  # vLLM's extra key of LoRA blocks
        req = Request(
            request_id,
            num_prompt_tokens=n,
            max_tokens=max(1, min(max_tokens, mml - n)) if not pooling else 0,
            block_size=self.block_size,
            prompt_token_ids=prompt_token_ids,
            block_hashes=block_hashes,
            priority=priority,
            lora_id=lora_id,
            lora_name=lora,
            stop_after=stop_after,
            pooling=pooling,
            output_salt=output_salt,
        )
        req.hash_extra = hash_extra
        return req

    def add_request(self, request: Request, now: float) -> None:
        request.arrival_time = now
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a waiting or running request (client gone); its blocks are freed at once."""
        done = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        return done[0] if done else None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``/reset_prefix_cache``); refused (False) while any
        request holds blocks. Its ``AllBlocksCleared`` goes out with the next step's events."""
        return self.block_pool.reset_prefix_cache()

    def _flush_kv_events(self) -> None:
        events = self.block_pool.take_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- LoRA ----------------------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        if name in self.loras:
            raise ValueError(f"adapter {name!r} is already loaded")
        adapter = LoRAAdapter(name, self._next_lora_id, path)
        self._next_lora_id += 1
        self.loras[name] = adapter
        return adapter

    def unload_lora(self, name: str) -> LoRAAdapter:
        return self.loras.pop(name)

    # -- one step ------------------------------------------------------------------------------

    def begin_step(self, now: float) -> StepOutput | None:
        """Schedule one step at ``now``; ``None`` when there is nothing to run."""
        if not self.scheduler.has_requests():
            return None
        out = self.scheduler.schedule()
        for r in out.scheduled_new_reqs:
            if r.first_scheduled_time is None:
                r.first_scheduled_time = max(now, r.arrival_time)
        n = out.total_num_scheduled_tokens
        if n == 0:
            # Nothing fits this step (cannot happen with a sane config); idle for one overhead.
            return StepOutput(out, now, self.cost.step_time(1, 1, 0, 0, 1), 0.0, 0.0, 0.0)
        c = self.cost.step_cost(n, out.num_seqs, out.num_sampled, out.kv_context_tokens, out.attention_pairs)
        return StepOutput(out, now, c.seconds, c.flops, c.read_bytes, c.write_bytes)

    def end_step(self, step: StepOutput, now: float) -> tuple[list[Request], list[Request]]:
        """Finish the step at ``now``: requests that produced output, and those that finished."""
        out = step.sched
        produced, finished = self.scheduler.update_from_output(out)
        m = self.counters
        self.num_steps += 1
        self.busy_seconds += now - step.begin
        m.flops += step.flops
        m.read_bytes += step.read_bytes
        m.write_bytes += step.write_bytes
        if out.total_num_scheduled_tokens:
            m.iteration_tokens.observe(out.total_num_scheduled_tokens)
        gen = 0
        for r in produced:
            if r.pooling:
                self._first_output(r, now)
                continue
            gen += 1
            if r.first_token_time is None:
                self._first_output(r, now)
            else:
                assert r.last_token_time is not None
                m.itl.observe(now - r.last_token_time)
            r.last_token_time = now
        m.generation_tokens += gen
        for r in finished:
            self._record_finished(r, now)
        self._update_lora_info()
        if self.block_pool.kv_event_queue is not None:
            self._flush_kv_events()  # one batch per step, as vLLM publishes
        return produced, finished

    def _first_output(self, r: Request, now: float) -> None:
        m = self.counters
        r.first_token_time = now
        r.last_token_time = now
        m.ttft.observe(now - r.arrival_time)
        cached = max(r.num_cached_tokens, 0)
        m.prompt_tokens += r.num_prompt_tokens
        m.prompt_tokens_local_cache_hit += cached
        m.prompt_tokens_local_compute += r.num_prompt_tokens - cached

    def _record_finished(self, r: Request, now: float) -> None:
        m = self.counters
        reason = RequestStatus.get_finished_reason(r.status) or "stop"
        m.request_success[reason] += 1
        first = r.first_token_time if r.first_token_time is not None else now
        last = r.last_token_time if r.last_token_time is not None else now
        sched = r.first_scheduled_time if r.first_scheduled_time is not None else r.arrival_time
        m.e2e.observe(now - r.arrival_time)
        m.queue.observe(sched - r.arrival_time)
        m.inference.observe(last - sched)
        m.prefill.observe(first - sched)
        m.decode.observe(last - first)
        n = r.num_output_tokens
        m.tpot.observe((last - first) / (n - 1) if n > 1 else 0.0)
        m.prompt_len.observe(r.num_prompt_tokens)
        m.gen_len.observe(n)
        m.max_gen.observe(r.max_tokens)
        m.max_tokens_param.observe(r.max_tokens)
        m.params_n.observe(1)
        m.num_preemptions_hist.observe(r.num_preemptions)
        m.prefill_kv_computed.observe(r.num_prompt_tokens - max(r.num_cached_tokens, 0))

    # -- runs of identical decode steps (virtual time) ----------------------------------------

    def can_fast_forward(self) -> bool:
        return self.scheduler.can_fast_forward()

    def steady_limit(self, max_steps: int = 1 << 40) -> int:
        """How many of the next steps are known to decode exactly the running set."""
        return self.scheduler.max_fast_forward_steps(max_steps)

    def _steady_terms(self) -> tuple[int, float, float, int]:
        # A decode step's time is A + S * context: batch B is fixed, context grows by B a step.
        running = self.scheduler.running
        b = len(running)
        ctx = 0
        for r in running:
            ctx += r.num_computed_tokens
        a, s = self.cost.decode_terms(b)
        return b, a, s, ctx

    def steady_end_time(self, t0: float, k: int) -> float:
        """When ``k`` steady steps starting at ``t0`` end."""
        b, a, s, ctx = self._steady_terms()
        return t0 + k * (a + s * ctx) + s * b * k * (k - 1) / 2

    def steady_steps_until(self, t0: float, until: float, k_max: int) -> int:
        """The most steady steps (at most ``k_max``) starting at ``t0`` that end by ``until``."""
        if k_max <= 0 or until <= t0:
            return 0
        b, a, s, ctx = self._steady_terms()
        first = a + s * ctx
        span = until - t0
        half = s * b / 2
        if half <= 0:
            k = int(span // first)
        else:
            # half k^2 + (first - half) k - span <= 0
            lin = first - half
            k = int((-lin + math.sqrt(lin * lin + 4 * half * span)) / (2 * half))
        k = max(0, min(k, k_max))
        while k > 0 and k * first + half * k * (k - 1) > span:
            k -= 1
        while k < k_max and (k + 1) * first + half * (k + 1) * k <= span:
            k += 1
        return k

    def advance_steady(self, t0: float, k: int) -> float:
        """Apply ``k`` steady steps starting at ``t0`` (``k <= steady_limit()``); returns their end."""
        if k <= 0:
            return t0
        b, a, s, ctx = self._steady_terms()
        first = a + s * ctx
        step = s * b
        t_end = t0 + k * first + step * k * (k - 1) / 2
        m = self.counters
        m.itl.observe_arithmetic(first, step, k, b)
        m.iteration_tokens.observe(b, k)
        m.generation_tokens += k * b
        flops, read, write = self.cost.decode_run_work(b, ctx, k)
        m.flops += flops
        m.read_bytes += read
        m.write_bytes += write
        self.scheduler.fast_forward(k)
        if self.block_pool.kv_event_queue is not None:
            self._flush_kv_events()  # k steps' events in one batch
        for r in self.scheduler.running:
            r.last_token_time = t_end
        self.num_steps += k
        self.busy_seconds += t_end - t0
        return t_end

    # -- metrics -------------------------------------------------------------------------------

    def _update_lora_info(self) -> None:
        if self.config.max_loras <= 0:
            return
        sched = self.scheduler
        if self.loras:
            names = {a.lora_id: a.name for a in self.loras.values()}
            running = ",".join(sorted({names.get(r.lora_id, "") for r in sched.running if r.lora_id} - {""}))
            waiting_ids = {r.lora_id for r in sched.waiting.unordered() if r.lora_id}
            waiting = ",".join(sorted({names.get(i, "") for i in waiting_ids} - {""}))
            key = (running, waiting)
        else:
            key = ("", "")
        info = self._lora_info
        info[key] = self.wall_clock()
        info.move_to_end(key)
        while len(info) > _MAX_LORA_INFO_SERIES:
            info.popitem(last=False)

    def snapshot(self) -> LoadSnapshot:
        """The engine's load, as the router and the scheduler see every replica."""
        m = self.counters
        sched = self.scheduler
        stats = sched.prefix_cache_stats
        running_l: frozenset[str] = frozenset()
        waiting_l: frozenset[str] = frozenset()
        max_lora: int | None = None
        if self.config.max_loras > 0 and self._lora_info:
            (run_s, wait_s) = next(reversed(self._lora_info))
            running_l = frozenset(a for a in run_s.split(",") if a)
            waiting_l = frozenset(a for a in wait_s.split(",") if a)
            max_lora = self.config.max_loras
        return LoadSnapshot(
            num_running=float(len(sched.running)),
            num_waiting=float(len(sched.waiting)),
            kv_cache_usage=self.block_pool.get_usage(),
            prefix_cache_queries=float(stats.queries),
            prefix_cache_hits=float(stats.hits),
            num_preemptions=float(sched.num_preemptions),
            prompt_tokens=float(m.prompt_tokens),
            generation_tokens=float(m.generation_tokens),
            requests_finished=float(sum(m.request_success.values())),
            running_lora_adapters=running_l,
            waiting_lora_adapters=waiting_l,
            max_lora=max_lora,
            ttft=m.ttft.copy(),
            queue_time=m.queue.copy(),
            inter_token_latency=m.itl.copy(),
            e2e_latency=m.e2e.copy(),
            block_size=self.block_size,
            num_gpu_blocks=self.config.num_gpu_blocks,
            model_names=frozenset({self.config.served_model_name}),
        )

    def render_metrics(self) -> str:
        """The engine's part of a vLLM ``/metrics`` page (Prometheus text format)."""
        return generate_latest(self.metrics_registry).decode()

    def collect(self) -> Iterator[Metric]:
        """vLLM's metric families for this engine (a ``prometheus_client`` collector): the
        families, types, labels and HELP texts of vLLM 0.33, with their ``_created`` series."""
        cfg = self.config
        base = {"engine": str(cfg.engine_index), "model_name": cfg.served_model_name}
        m = self.counters
        sched = self.scheduler
        stats = sched.prefix_cache_stats
        created = self.created

        def one(value: float) -> list[tuple[dict[str, str], float]]:
            return [(base, value)]

        def counter(name: str, doc: str, series: list[tuple[dict[str, str], float]]) -> Metric:
            return counter_family(name, doc, series, created=created)

        def hist(name: str, doc: str, h: Histogram) -> Metric:
            return histogram_family(name, doc, [(base, h)], created=created)

        yield gauge_family(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            one(len(sched.running)),
        )
        yield gauge_family(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            one(len(sched.waiting)),
        )
        deferred = (
            sum(1 for r in sched.waiting.unordered() if r.lora_id in sched.skipped_lora_ids)
            if sched.skipped_lora_ids
            else 0
        )
        yield gauge_family(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.",
            [
                ({**base, "reason": "capacity"}, len(sched.waiting) - deferred),
                ({**base, "reason": "deferred"}, deferred),
            ],
        )
        yield gauge_family(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [
                ({**base, "sleep_state": "awake"}, 1),
                ({**base, "sleep_state": "weights_offloaded"}, 0),
                ({**base, "sleep_state": "discard_all"}, 0),
            ],
        )
        yield gauge_family(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            one(self.block_pool.get_usage()),
        )
        yield counter(
            "vllm:estimated_flops_per_gpu",
            "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).",
            one(m.flops),
        )
        yield counter(
            "vllm:estimated_read_bytes_per_gpu",
            "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).",
            one(m.read_bytes),
        )
        yield counter(
            "vllm:estimated_write_bytes_per_gpu",
            "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).",
            one(m.write_bytes),
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            one(stats.queries),
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            one(stats.hits),
        )
        yield counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
            one(0),
        )
        yield counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            one(0),
        )
        yield counter(
            "vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", one(0)
        )
        yield counter(
            "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", one(0)
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            one(sched.num_preemptions),
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", one(m.prompt_tokens))
        yield counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [
                ({**base, "source": "local_compute"}, m.prompt_tokens_local_compute),
                ({**base, "source": "local_cache_hit"}, m.prompt_tokens_local_cache_hit),
                ({**base, "source": "external_kv_transfer"}, 0),
            ],
        )
        yield counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            one(m.prompt_tokens_local_cache_hit),
        )
        yield counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            [
                ({**base, "source": s}, stats.hits if s == "device" else 0)
                for s in ("device", "host", "p2p", "disk", "external_unspecified")
            ],
        )
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", one(m.generation_tokens)
        )
        yield counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [({**base, "finished_reason": r}, m.request_success[r]) for r in FINISH_REASONS],
        )
        yield counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            [
                ({"model_name": cfg.served_model_name, "reason": r}, self.admission_rejections.get(r, 0))
                for r in ("max_num_queued_reqs", "max_num_queued_tokens")
            ],
        )
        yield hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", m.prompt_len)
        yield hist("vllm:request_generation_tokens", "Number of generation tokens processed.", m.gen_len)
        yield hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            m.iteration_tokens,
        )
        yield hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            m.max_gen,
        )
        yield hist("vllm:request_params_n", "Histogram of the n request parameter.", m.params_n)
        yield hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            m.max_tokens_param,
        )
        yield hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft)
        yield hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl)
        yield hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            m.tpot,
        )
        yield hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m.e2e)
        yield hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            m.queue,
        )
        yield hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            m.inference,
        )
        yield hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            m.prefill,
        )
        yield hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            m.decode,
        )
        yield hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            m.num_preemptions_hist,
        )
        yield hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            m.prefill_kv_computed,
        )
        if cfg.max_loras > 0:
            # A gauge, not an info family: its value is when the adapter set was last current.
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            for (run, wait), ts in self._lora_info.items():
                lora.add_metric([str(cfg.max_loras), run, wait], ts)
            yield lora
        info = InfoMetricFamily("vllm:cache_config", "Information of the LLMEngine CacheConfig")
        info.add_metric([], self._cache_config_labels())
        yield info

    def _cache_config_labels(self) -> dict[str, str]:
        cfg = self.config
        bs = cfg.block_size
        tokens = cfg.num_gpu_blocks * bs
        kv_bytes = int(tokens * self.cost.kv_bytes_per_token_per_gpu())
        return {
            "_block_size_resolved": "True",
            "block_size": str(bs),
            "cache_dtype": "auto" if self.preset.model.kv_bytes_per_elem >= 2 else "fp8",
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(bs),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "engine": str(cfg.engine_index),
            "gpu_memory_utilization": str(self.preset.gpu_memory_utilization),
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(round(tokens / cfg.max_model_len, 2)),
            "kv_cache_memory_bytes": str(kv_bytes),
            "kv_cache_size_tokens": str(tokens),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "float32",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": cfg.prefix_caching_hash_algo,
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": "False",
        }
