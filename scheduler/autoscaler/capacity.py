"""How much load one replica of a pool carries within the latency targets.

The autoscaler turns request rates into replica counts through a :class:`ReplicaCapacity`:

* :class:`StaticCapacity` -- numbers given up front: the fleet config's
  ``capacity_rps_per_replica``, or what :func:`plan_capacity` found (``capacity_from: plan``);
* :func:`plan_capacity` -- one replica's requests/s at the SLO, measured as ``tidal plan``
  measures it (:func:`scheduler.plan.capacity.measure`: virtual-time replays on the simulated
  replica, its batch capped within the TPOT target; cached under the data dir, as it takes
  seconds), or read from a ``tidal plan --json`` file (:func:`known_plan`: without measuring);
* :class:`OnlineCapacity` -- starts from another capacity and learns from the requests per
  second the pool's replicas sustained within the SLO, or failed to (``learn_capacity``).

Example::

    plan = plan_capacity(fleet, fleet.pools["interactive"], cache_path=data_dir / "capacity-plans.json")
    capacity = OnlineCapacity(StaticCapacity({"interactive": plan.rps}), {"interactive": plan.slo})
    capacity.capacity_rps("interactive")
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tidal.fleet import AutoscalerSpec, FleetConfig, PoolSpec
from tidal.replicas.sim.capacity import CapacityError, Slo
from tidal.replicas.sim.presets import get_preset
from tidal.replicas.sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest
from tidal.scheduler.signals import PoolLoad

if TYPE_CHECKING:
    from tidal.scheduler.plan.workload import Workload

__all__ = [
    "CapacityPlan",
    "LearnsCapacity",
    "OnlineCapacity",
    "ReplicaCapacity",
    "StaticCapacity",
    "known_plan",
    "plan_capacity",
    "pool_slo",
    "read_plan_file",
]

log = logging.getLogger(__name__)

# Bump when the measurement changes meaning, so cached plans are measured again.
_PLAN_VERSION = 2
_MAX_PLAN_FILE_BYTES = 16 * 1024 * 1024
_UNIQUE_PREFIX_BASE = 1 << 45  # prefix ids of planned requests: shared with no trace's


class ReplicaCapacity(Protocol):
    """Requests per second one replica of ``pool`` serves while meeting the TTFT/TPOT targets."""

    def capacity_rps(self, pool: str) -> float: ...


@runtime_checkable
class LearnsCapacity(Protocol):
    """A capacity that learns from what the pool carried (the autoscaler feeds it every step)."""

    def observe(self, pool: str, load: PoolLoad, ready: int, *, lent_to_batch: bool) -> None: ...


class StaticCapacity:
    """Capacities given up front (the fleet config's ``capacity_rps_per_replica``, or a plan)."""

    def __init__(self, per_pool: Mapping[str, float], default: float | None = None) -> None:
        for pool, c in per_pool.items():
            if not c > 0:
                raise ValueError(f"capacity of pool {pool} must be positive")
        self._per_pool = dict(per_pool)
        self._default = default

    @classmethod
    def from_fleet(cls, fleet: FleetConfig) -> StaticCapacity:
        """The hand-set capacities (pools with ``capacity_from: plan`` get theirs from :meth:`set`)."""
        return cls(
            {
                n: p.autoscale.capacity_rps_per_replica
                for n, p in fleet.pools.items()
                if p.autoscale and p.autoscale.capacity_from == "static"
            }
        )

    def set(self, pool: str, rps: float) -> None:
        if not rps > 0:
            raise ValueError(f"capacity of pool {pool} must be positive")
        self._per_pool[pool] = rps

    def known(self, pool: str) -> bool:
        return pool in self._per_pool or self._default is not None

    def capacity_rps(self, pool: str) -> float:
        c = self._per_pool.get(pool, self._default)
        if c is None:
            raise KeyError(f"no replica capacity known for pool {pool}")
        return c


# -- planned capacity ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """One pool's planned capacity and where it comes from (for logs and ``tidal up``)."""

    pool: str
    rps: float
    slo: Slo
    source: str
    cached: bool = False


def pool_slo(fleet: FleetConfig, spec: AutoscalerSpec) -> Slo:
    """The SLO a pool's capacity is measured against: the plan's, else the ``interactive`` class's."""
    plan = spec.planned
    cls = fleet.classes.get("interactive")
    default = Slo() if cls is None else Slo(cls.ttft_slo_s, cls.tpot_slo_s)
    return Slo(plan.ttft_p95_s or default.ttft_p95_s, plan.tpot_p95_s or default.tpot_p95_s)


def read_plan_file(path: str | Path, tp: int | None = None) -> tuple[float, str]:
    """``requests_per_s_at_slo`` of one option of a ``tidal plan --json`` output, and a label.

    The file holds one object with ``options``, each with ``tp`` and ``requests_per_s_at_slo``;
    ``tp`` picks the option (needed when there are several).
    """
    p = Path(path)
    try:
        if p.stat().st_size > _MAX_PLAN_FILE_BYTES:
            raise CapacityError(f"{p}: larger than {_MAX_PLAN_FILE_BYTES} bytes; not a plan")
        data = json.loads(p.read_text())
    except OSError as exc:
        raise CapacityError(f"{p}: cannot read the plan: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CapacityError(f"{p}: not JSON ({exc})") from None
    options = data.get("options") if isinstance(data, dict) else None
    if not isinstance(options, list) or not options or not all(isinstance(o, dict) for o in options):
        raise CapacityError(f"{p}: not a tidal plan --json output (no 'options' list of objects)")
    if tp is None:
        if len(options) > 1:
            tps = ", ".join(str(o.get("tp")) for o in options)
            raise CapacityError(f"{p}: {len(options)} options (tp {tps}); pick one with plan.tp")
        chosen = options[0]
    else:
        found = [o for o in options if o.get("tp") == tp]
        if not found:
            tps = ", ".join(str(o.get("tp")) for o in options)
            raise CapacityError(f"{p}: no option with tp {tp} (options: tp {tps})")
        chosen = found[0]
    rps = chosen.get("requests_per_s_at_slo")
    if isinstance(rps, bool) or not isinstance(rps, int | float) or not math.isfinite(rps) or rps <= 0:
        raise CapacityError(f"{p}: requests_per_s_at_slo must be a positive number, got {rps!r}")
    return float(rps), f"tidal plan file {p} (tp {chosen.get('tp')})"


def _plan_key(preset: str, spec: AutoscalerSpec, slo: Slo) -> str:
    plan = spec.planned
    ident = {
        "version": _PLAN_VERSION,
        "preset": repr(get_preset(preset)),  # the model, GPU and efficiencies: a new calibration re-measures
        "prompt_tokens": list(plan.prompt_tokens),
        "output_tokens": list(plan.output_tokens),
        "slo": [slo.ttft_p95_s, slo.tpot_p95_s],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _plan_workload(prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], n: int = 2000) -> Workload:
    """``n`` requests with log-uniform lengths in the ranges, sharing no prefix (the measurement
    sets their rate)."""
    from tidal.scheduler.plan.workload import Workload

    rng = random.Random(0)

    def draw(lo: int, hi: int) -> int:
        return max(lo, min(hi, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))

    reqs = []
    for i in range(n):
        prompt = draw(*prompt_tokens)
        base = _UNIQUE_PREFIX_BASE + i * 65536
        ids = tuple(range(base, base + -(-prompt // MOONCAKE_BLOCK_TOKENS)))
        reqs.append(TraceRequest(i / 20.0, prompt, draw(*output_tokens), ids))
    return Workload(f"{n} requests of {prompt_tokens[0]}-{prompt_tokens[1]} prompt tokens", tuple(reqs))


def _plan_source(pool: PoolSpec, slo: Slo) -> tuple[str, str]:
    assert pool.autoscale is not None
    plan = pool.autoscale.planned
    preset = plan.preset or pool.sim_preset
    if preset is None:  # the fleet config refuses this; a hand-built one may not
        raise CapacityError(f"pools.{pool.name}.autoscale.plan: no preset to measure")
    try:
        get_preset(preset)
    except KeyError as exc:
        raise CapacityError(str(exc.args[0])) from None
    return preset, (
        f"{preset} replayed in virtual time as tidal plan does ({plan.prompt_tokens[0]}-{plan.prompt_tokens[1]} prompt, "
        f"{plan.output_tokens[0]}-{plan.output_tokens[1]} output tokens; TTFT p95 <= {slo.ttft_p95_s:g} s, "
        f"TPOT p95 <= {slo.tpot_p95_s:g} s)"
    )


def known_plan(fleet: FleetConfig, pool: PoolSpec, *, cache_path: Path | None = None) -> CapacityPlan | None:
    """The plan of ``pool`` if it needs no measuring (a ``tidal plan`` file, or measured before and
    cached in ``cache_path``), else ``None``. Raises :class:`~replicas.sim.capacity.CapacityError`
    for a plan that cannot be used (an unreadable file, an unknown preset)."""
    spec = pool.autoscale
    if spec is None or spec.capacity_from != "plan":
        raise ValueError(f"pools.{pool.name}: no autoscale section with capacity_from: plan")
    slo = pool_slo(fleet, spec)
    plan = spec.planned
    if plan.file is not None:
        rps, source = read_plan_file(plan.file, plan.tp)
        return CapacityPlan(pool.name, rps, slo, source)
    preset, source = _plan_source(pool, slo)
    if cache_path is not None:
        hit = _read_cache(cache_path).get(_plan_key(preset, spec, slo))
        if isinstance(hit, dict) and isinstance(hit.get("rps"), int | float) and hit["rps"] > 0:
            return CapacityPlan(pool.name, float(hit["rps"]), slo, source, cached=True)
    return None


def plan_capacity(fleet: FleetConfig, pool: PoolSpec, *, cache_path: Path | None = None) -> CapacityPlan:
    """The capacity of one replica of ``pool`` (``capacity_from: plan``); blocks while it measures
    (seconds to a minute: a bisection over virtual-time replays), then caches it in ``cache_path``.

    Raises :class:`~replicas.sim.capacity.CapacityError` (a ``ValueError``) with the reason when
    the plan cannot be read or measured.
    """
    known = known_plan(fleet, pool, cache_path=cache_path)
    if known is not None:
        return known
    spec = pool.autoscale
    assert spec is not None
    slo = pool_slo(fleet, spec)
    plan = spec.planned
    preset, source = _plan_source(pool, slo)
    from tidal.scheduler.plan.capacity import measure  # the planner's; imported only when measuring

    measured = measure(
        get_preset(preset), _plan_workload(plan.prompt_tokens, plan.output_tokens), slo, rel_tol=0.05
    )
    if cache_path is not None:
        try:
            cache = _read_cache(cache_path)
            cache[_plan_key(preset, spec, slo)] = {"rps": measured.rps, "source": source}
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, cache_path)
        except OSError as exc:  # the plan holds; the next start measures again
            log.warning("autoscaler: cannot cache the capacity plan in %s: %s", cache_path, exc)
    return CapacityPlan(pool.name, measured.rps, slo, source)


# -- learned capacity ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Sample:
    per_replica_rps: float
    within: bool


class OnlineCapacity:
    """Learns each pool's capacity from what its replicas sustained within the SLO.

    Starts from ``prior``. Every autoscaler step gives one sample: the requests per second per
    ready replica, and whether the pool met its SLO (TTFT p95 and TPOT p95 within the targets,
    queue wait p95 within ``queue_wait_p95_s``). Samples taken while the pool is lent to batch
    (batch sequences share its steps) or with no replica ready are skipped. When ``confirm``
    samples in a row met the SLO at more per replica than the estimate, the estimate rises to
    the least of them (the replicas carried it); when ``confirm`` samples in a row breached it at
    less than the estimate, it falls to the most of them (they could not). A short burst or one
    slow request moves nothing. The estimate stays within ``[min_factor, max_factor]`` x prior.

    **Parameters:** ``prior`` -- the starting capacity; ``slos`` -- per learning pool;
    ``confirm`` (4: a minute at the default 15 s decisions); ``queue_wait_p95_s`` (0.5);
    ``min_factor`` (0.25), ``max_factor`` (4.0); ``learned`` -- estimates saved earlier.
    """

    def __init__(
        self,
        prior: ReplicaCapacity,
        slos: Mapping[str, Slo],
        *,
        confirm: int = 4,
        queue_wait_p95_s: float = 0.5,
        min_factor: float = 0.25,
        max_factor: float = 4.0,
        learned: Mapping[str, float] | None = None,
    ) -> None:
        if confirm < 1 or not 0 < min_factor <= 1 <= max_factor:
            raise ValueError("confirm must be >= 1 and min_factor <= 1 <= max_factor")
        self.prior = prior
        self.slos = dict(slos)
        self.confirm = confirm
        self.queue_wait_p95_s = queue_wait_p95_s
        self.min_factor = min_factor
        self.max_factor = max_factor
        self._estimate: dict[str, float] = {}
        self._recent: dict[str, deque[_Sample]] = {p: deque(maxlen=confirm) for p in self.slos}
        self._saved = dict(learned or {})

    def _bounds(self, pool: str) -> tuple[float, float]:
        prior = self.prior.capacity_rps(pool)
        return prior * self.min_factor, prior * self.max_factor

    def capacity_rps(self, pool: str) -> float:
        if pool not in self.slos:
            return self.prior.capacity_rps(pool)
        est = self._estimate.get(pool)
        if est is None:
            lo, hi = self._bounds(pool)
            saved = self._saved.get(pool)
            est = self.prior.capacity_rps(pool) if saved is None else min(hi, max(lo, saved))
            self._estimate[pool] = est
        return est

    def learned(self) -> dict[str, float]:
        """The current estimates of the learning pools (to save and pass back as ``learned``)."""
        return {p: self._estimate[p] for p in self.slos if p in self._estimate}

    def observe(self, pool: str, load: PoolLoad, ready: int, *, lent_to_batch: bool) -> None:
        slo = self.slos.get(pool)
        serving = int(load.replicas_serving) or ready
        if slo is None or lent_to_batch or serving <= 0 or load.requests_per_s <= 0:
            return
        within = (
            load.ttft_p95_s <= slo.ttft_p95_s
            and load.tpot_p95_s <= slo.tpot_p95_s
            and load.queue_wait_p95_s <= self.queue_wait_p95_s
        )
        recent = self._recent[pool]
        recent.append(_Sample(load.requests_per_s / serving, within))
        if len(recent) < self.confirm:
            return
        est = self.capacity_rps(pool)
        lo, hi = self._bounds(pool)
        if all(s.within for s in recent):
            carried = min(s.per_replica_rps for s in recent)
            if carried > est:
                self._set(pool, min(hi, carried), f"carried {carried:.2f} rps per replica within the SLO")
        elif not any(s.within for s in recent):
            failed = max(s.per_replica_rps for s in recent)
            if failed < est:
                self._set(pool, max(lo, failed), f"breached the SLO at {failed:.2f} rps per replica")

    def _set(self, pool: str, value: float, why: str) -> None:
        old = self._estimate.get(pool)
        self._estimate[pool] = value
        self._recent[pool].clear()  # the next move needs fresh evidence at the new size
        log.info("autoscaler %s: capacity %.2f -> %.2f rps per replica (%s)", pool, old or 0.0, value, why)
