"""N simulated replicas in one process on a discrete-event clock: no HTTP, no sleeping.

Replays an hour of trace in seconds. Each replica is a :class:`SimEngine` stepping in virtual
time; a run of steps that only decode the same requests (the common case between arrivals and
finishes) is applied in closed form and only as far as someone looks (a callback, a submit, an
``engines[i]`` access), so the cost of a replay grows with the number of requests, not of steps.
Results are exactly those of stepping one step at a time (``fast_forward=False``).

Example::

    from tidal.replicas.sim.virtual import VirtualCluster, SimRequest

    cluster = VirtualCluster(preset="llama-3.1-70b-fp8-h200-tp4", replicas=8, seed=0)
    done = []

    def arrive(c: VirtualCluster) -> None:
        c.submit(0, SimRequest("r1", max_tokens=128, prompt_token_ids=list(range(2000)),
                               on_finish=done.append))

    cluster.at(0.5, arrive)           # callbacks run at virtual times: arrivals, scrapes, loops
    cluster.run()                     # process events in time order (until=None: to the end)
    done[0].ttft, done[0].e2e         # virtual seconds
    cluster.engines[0].snapshot()     # replicas.metrics.LoadSnapshot, as scraped from /metrics

Requests are given as token ids, or (for traces) as chained block hashes plus a prompt length:
``SimRequest("r2", max_tokens=300, block_hashes=hashes, num_prompt_tokens=12000)``, where
``hashes`` holds one hash per full block of the preset's block size (16 tokens on GPU presets).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tidal.replicas.sim.engine import SimEngine, StepOutput
from tidal.replicas.sim.presets import Preset
from tidal.replicas.sim.request import Request, RequestStatus

__all__ = ["SimRequest", "SimResult", "VirtualCluster"]


@dataclass(frozen=True)
class SimResult:
    """What happened to one request (times in virtual seconds)."""

    request_id: str
    replica: int
    arrival: float
    first_token_time: float | None
    finish_time: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int
    finish_reason: str

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def preempted(self) -> bool:
        return self.num_preemptions > 0


@dataclass
class SimRequest:
    """A request to submit to one replica of a :class:`VirtualCluster`.

    Give ``prompt_token_ids``, or ``block_hashes`` (one chained hash per full block) with
    ``num_prompt_tokens``. ``stop_after`` ends the answer early (finish reason ``stop``);
    ``lora`` names an adapter loaded on that replica (``engines[i].load_lora``).
    """

    request_id: str
    max_tokens: int
    prompt_token_ids: Sequence[int] | None = None
    block_hashes: Sequence[int] | None = None
    num_prompt_tokens: int | None = None
    priority: int = 0
    lora: str | None = None
    stop_after: int | None = None
    on_first_token: Callable[[float], Any] | None = None
    on_finish: Callable[[SimResult], Any] | None = None


_IDLE, _STEP, _RUN, _BETWEEN = 0, 1, 2, 3


class _Replica:
    """Drives one engine in virtual time: idle, in a real step, or in a run of steady steps."""

    __slots__ = ("engine", "index", "k_left", "mode", "step", "t_next", "version")

    def __init__(self, engine: SimEngine, index: int) -> None:
        self.engine = engine
        self.index = index
        self.mode = _IDLE
        self.step: StepOutput | None = None
        self.t_next = 0.0  # RUN: when the next not-yet-applied steady step begins
        self.k_left = 0  # RUN: steady steps left before a step that must be taken normally
        self.version = 0  # bumps invalidate this replica's pending event


class _EngineView(Sequence[SimEngine]):
    """``cluster.engines[i]``: the engine, brought up to the cluster's current time first."""

    def __init__(self, cluster: VirtualCluster) -> None:
        self._cluster = cluster

    def __len__(self) -> int:
        return len(self._cluster._replicas)

    def __getitem__(self, i: int) -> SimEngine:  # type: ignore[override]
        rep = self._cluster._replicas[i]
        self._cluster._sync(rep)
        return rep.engine

    def __iter__(self) -> Iterator[SimEngine]:
        for i in range(len(self)):
            yield self[i]


class VirtualCluster:
    """Simulated replicas on one discrete-event clock (see the module docstring).

    **Parameters:** ``preset`` (a name, or one name per replica), ``replicas``, ``seed``,
    ``fast_forward`` (apply steady decode runs in closed form; ``False`` steps one by one, for
    checking), and engine overrides (``max_num_seqs``, ``max_num_batched_tokens``,
    ``num_gpu_blocks``, ``policy``, ``max_loras``, ``check_invariants``, ...).
    """

    def __init__(
        self,
        preset: str | Preset | Sequence[str | Preset] = "llama-3.1-70b-fp8-h200-tp4",
        replicas: int = 1,
        *,
        seed: int = 0,
        fast_forward: bool = True,
        **engine_overrides: Any,
    ) -> None:
        self.now = 0.0
        self.seed = seed
        self.fast_forward = fast_forward
        self._overrides = engine_overrides
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._replicas: list[_Replica] = []
        presets = [preset] * replicas if isinstance(preset, (str, Preset)) else list(preset)
        for p in presets:
            self.add_replica(p)
        self.engines: Sequence[SimEngine] = _EngineView(self)
        self.num_events = 0

    def add_replica(self, preset: str | Preset | None = None) -> int:
        """Start one more replica (ready at once; model a cold start with ``at``); its index."""
        if preset is None:
            preset = self._replicas[0].engine.preset if self._replicas else "llama-3.1-8b-h100"
        index = len(self._replicas)
        engine = SimEngine(
            preset,
            seed=self.seed + index,
            wall_clock=lambda: self.now,
            engine_index=0,
            **self._overrides,
        )
        self._replicas.append(_Replica(engine, index))
        return index

    # -- the public API ------------------------------------------------------------------------

    def at(self, t: float, callback: Callable[[VirtualCluster], Any]) -> None:
        """Run ``callback(cluster)`` at virtual time ``t`` (not in the past)."""
        if t < self.now:
            raise ValueError(f"cannot schedule at {t} before now ({self.now})")
        heapq.heappush(self._events, (t, 1, next(self._seq), callback))

    def submit(self, replica: int, request: SimRequest) -> None:
        """Hand ``request`` to replica ``replica`` now."""
        rep = self._replicas[replica]
        self._sync(rep)
        self._materialize(rep)
        engine = rep.engine
        r = engine.make_request(
            request.request_id,
            max_tokens=request.max_tokens,
            prompt_token_ids=request.prompt_token_ids,
            block_hashes=request.block_hashes,
            num_prompt_tokens=request.num_prompt_tokens,
            priority=request.priority,
            lora=request.lora,
            stop_after=request.stop_after,
        )
        r.user_data = request
        engine.add_request(r, self.now)
        if rep.mode == _IDLE:
            self._begin_step(rep, self.now)

    def abort(self, replica: int, request_id: str) -> bool:
        """Abort a request (as a client disconnect would); its ``on_finish`` sees reason ``abort``."""
        rep = self._replicas[replica]
        self._sync(rep)
        self._materialize(rep)
        r = rep.engine.abort_request(request_id)
        if r is None:
            return False
        self._finish(rep, r, self.now)
        return True

    def run(self, until: float | None = None) -> None:
        """Process events in time order, up to ``until`` (virtual seconds) or until none is left."""
        events = self._events
        while events and (until is None or events[0][0] <= until):
            t, kind, _, payload = heapq.heappop(events)
            self.now = t
            self.num_events += 1
            if kind == 1:
                payload(self)
                continue
            rep, version = payload
            if version != rep.version:
                continue  # superseded
            self._on_replica_event(rep, t)
        if until is not None and until > self.now:
            self.now = until

    def pending(self) -> int:
        """Events still queued (callbacks and replica steps)."""
        return len(self._events)

    # -- replica driving -----------------------------------------------------------------------

    def _push(self, rep: _Replica, t: float) -> None:
        rep.version += 1
        heapq.heappush(self._events, (t, 0, next(self._seq), (rep, rep.version)))

    def _begin_step(self, rep: _Replica, t: float) -> None:
        step = rep.engine.begin_step(t)
        if step is None:
            rep.mode = _IDLE
            rep.step = None
            rep.version += 1
            return
        rep.mode = _STEP
        rep.step = step
        self._push(rep, t + step.duration)

    def _on_replica_event(self, rep: _Replica, t: float) -> None:
        engine = rep.engine
        if rep.mode == _STEP:
            step = rep.step
            assert step is not None
            rep.mode = _BETWEEN
            rep.step = None
            produced, finished = engine.end_step(step, t)
            for r in produced:
                sr = r.user_data
                if r.num_output_tokens == 1 and isinstance(sr, SimRequest) and sr.on_first_token:
                    sr.on_first_token(t)
            for r in finished:
                self._finish(rep, r, t)
        elif rep.mode == _RUN:
            # The end of a steady run: apply what is left, then a normal step.
            rep.t_next = engine.advance_steady(rep.t_next, rep.k_left)
            rep.k_left = 0
            t = max(t, rep.t_next)
        else:
            return
        self._next(rep, t)

    def _next(self, rep: _Replica, t: float) -> None:
        engine = rep.engine
        if not engine.has_work():
            rep.mode = _IDLE
            rep.version += 1
            return
        if self.fast_forward and engine.can_fast_forward():
            k = engine.steady_limit()
            if k > 0:
                rep.mode = _RUN
                rep.t_next = t
                rep.k_left = k
                self._push(rep, engine.steady_end_time(t, k))
                return
        self._begin_step(rep, t)

    def _sync(self, rep: _Replica) -> None:
        # Apply the steady steps of a run that have ended by now.
        if rep.mode != _RUN:
            return
        k = rep.engine.steady_steps_until(rep.t_next, self.now, rep.k_left)
        if k:
            rep.t_next = rep.engine.advance_steady(rep.t_next, k)
            rep.k_left -= k

    def _materialize(self, rep: _Replica) -> None:
        # Something is about to change this replica mid-run: the steady step under way (begun
        # at t_next, before the change) becomes a normal step, so the change is seen next step.
        if rep.mode != _RUN:
            return
        if rep.k_left == 0:
            # The run ended exactly now and its event is still queued: take its place.
            self._next(rep, rep.t_next)
            return
        self._begin_step(rep, rep.t_next)
        rep.k_left = 0

    def _finish(self, rep: _Replica, r: Request, t: float) -> None:
        sr = r.user_data
        if not isinstance(sr, SimRequest) or sr.on_finish is None:
            return
        reason = RequestStatus.get_finished_reason(r.status) or "stop"
        sr.on_finish(
            SimResult(
                request_id=r.request_id,
                replica=rep.index,
                arrival=r.arrival_time,
                first_token_time=r.first_token_time,
                finish_time=t,
                num_prompt_tokens=r.num_prompt_tokens,
                num_cached_tokens=max(r.num_cached_tokens, 0),
                num_output_tokens=r.num_output_tokens,
                num_preemptions=r.num_preemptions,
                finish_reason=reason,
            )
        )
