"""``tidal bench fairness``: two tenants of one class in a saturated pool, fair share against FIFO.

A heavy tenant sends ten times the light one's rate; together they offer ``--load`` (1.5) times
what the pool serves. The requests go through the product's own admission and router (the
routing benchmark's :class:`~bench.routing.VirtualGateway`: ``priority.admission.Admission`` and
the ``tidal`` profile over simulated 70B replicas, in virtual time), once with fair share across
tenants (``gateway.admission_policy: fair``, the default) and once with one arrival order
(``fifo``, the earlier behaviour), and once with the light tenant alone. The class keeps the
interactive wait budget (2 s): what would wait longer is refused with a 429, and counted.

Per policy the rows give the light tenant's share of the answered requests against its fair
share (max-min: what it asks for, or half of what the pool answered when it asks for more), its
TTFT p95 against the one it gets alone, and what each tenant had refused. The pool's capacity is
measured first, in the same run (a heavy overload answered for as long as the full run lasts),
and the offered load set from it.

Example::

    tidal bench fairness --quick
    tidal bench fairness --load 2.0 --seconds 600
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from tidal.bench.prompt_views import prepare_views
from tidal.bench.routing import PRESET, VirtualGateway, bench_fleet
from tidal.fleet import ClassSpec, FleetConfig, TenantSpec
from tidal.priority.window import quantile
from tidal.replicas.sim.traces import TraceRequest
from tidal.replicas.sim.virtual import VirtualCluster

__all__ = ["run"]

HEAVY, LIGHT = "heavy", "light"
REPLICAS = 2
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class _Arrival:
    request: TraceRequest
    tenant: str


def _requests(rate: float, seconds: float, tenant: str, rng: random.Random) -> list[_Arrival]:
    """Poisson arrivals of prompts of 200-2,000 tokens and answers of 50-300, sharing no prefix."""
    out: list[_Arrival] = []
    t = rng.expovariate(rate)
    while t < seconds:
        n_in = rng.randint(200, 2000)
        blocks = tuple(rng.getrandbits(62) for _ in range(-(-n_in // BLOCK_TOKENS)))
        req = TraceRequest(t, n_in, rng.randint(50, 300), blocks, BLOCK_TOKENS)
        out.append(_Arrival(req, tenant))
        t += rng.expovariate(rate)
    return out


def _fleet(policy: str) -> FleetConfig:
    fleet = bench_fleet(REPLICAS)
    classes = dict(fleet.classes)
    classes["interactive"] = ClassSpec(priority=0, wait_budget_s=2.0, tpot_slo_s=0.05)
    return fleet.model_copy(
        update={
            "classes": classes,
            "tenants": [TenantSpec(name=HEAVY), TenantSpec(name=LIGHT)],
            "gateway": fleet.gateway.model_copy(update={"admission_policy": policy, "max_queue": 256}),
        }
    )


def _replay(arrivals: list[_Arrival], policy: str, seed: int) -> dict[str, Any]:
    cluster = VirtualCluster(PRESET, REPLICAS, seed=seed, max_num_batched_tokens=1024)
    gw = VirtualGateway(cluster, _fleet(policy), "tidal", seed=seed)
    ordered = sorted(arrivals, key=lambda a: a.request.arrival_s)
    for a, view in zip(ordered, prepare_views([a.request for a in ordered]), strict=True):
        gw.arrive(a.request, a.request.arrival_s, view, a.tenant)
    cluster.run()
    horizon = max((a.request.arrival_s for a in arrivals), default=0.0)
    start = 0.1 * horizon  # leave out the start, while the queue and the caps settle
    out: dict[str, Any] = {"horizon_s": horizon}
    for tenant in (HEAVY, LIGHT):
        served = [o for o in gw.served if o.tenant == tenant and o.arrival >= start]
        ttft = [
            o.result.first_token_time - o.arrival for o in served if o.result.first_token_time is not None
        ]
        out[tenant] = {
            "offered": sum(1 for a in arrivals if a.tenant == tenant and a.request.arrival_s >= start),
            "served": len(served),
            "refused": gw.refused_by[tenant],
            "ttft_p95_s": quantile(ttft, 0.95) if ttft else None,
            "ttft_p50_s": quantile(ttft, 0.5) if ttft else None,
        }
    return out


def run(
    quick: bool,
    out_dir: Path,
    load: str | float = 1.5,
    ratio: str | float = 10.0,
    seconds: str | float | None = None,
    seed: str | int = 0,
    **_: Any,
) -> list[dict[str, Any]]:
    """Rows per policy: ``policy``, ``light_share``, ``light_fair_share``, ``light_ttft_p95_s``,
    ``light_alone_ttft_p95_s`` (the contract), plus the heavy tenant's figures and refusals."""
    secs = float(seconds) if seconds is not None else (120.0 if quick else 600.0)
    seed = int(seed)
    rng = random.Random(seed)
    # The pool's capacity: a heavy overload, answered as fast as the pool goes.
    probe = _replay(_requests(40.0, secs, HEAVY, random.Random(seed + 1)), "fifo", seed)
    capacity = probe[HEAVY]["served"] / (0.9 * probe["horizon_s"])
    total = float(load) * capacity
    light_rate = total / (float(ratio) + 1.0)
    heavy = _requests(total - light_rate, secs, HEAVY, rng)
    light = _requests(light_rate, secs, LIGHT, rng)
    click.echo(
        f"{REPLICAS} simulated replicas ({PRESET}) serve {capacity:.2f} requests/s; offered {load}x that "
        f"for {secs:g} s (heavy {total - light_rate:.2f}/s, light {light_rate:.2f}/s); wait budget 2 s"
    )
    alone = _replay(light, "fair", seed)[LIGHT]
    rows: list[dict[str, Any]] = []
    for policy in ("fair", "fifo"):
        got = _replay(heavy + light, policy, seed)
        h, lt = got[HEAVY], got[LIGHT]
        served = h["served"] + lt["served"]
        fair_share = min(lt["offered"], served / 2) / served if served else 0.0
        rows.append(
            {
                "policy": policy,
                "light_share": lt["served"] / served if served else 0.0,
                "light_fair_share": fair_share,
                "light_ttft_p95_s": lt["ttft_p95_s"],
                "light_alone_ttft_p95_s": alone["ttft_p95_s"],
                "light_ttft_vs_alone": (lt["ttft_p95_s"] or 0.0) / alone["ttft_p95_s"]
                if alone["ttft_p95_s"]
                else None,
                "light_offered": lt["offered"],
                "light_served": lt["served"],
                "light_refused": lt["refused"],
                "heavy_served": h["served"],
                "heavy_refused": h["refused"],
                "heavy_ttft_p95_s": h["ttft_p95_s"],
                "capacity_rps": capacity,
                "offered_load": float(load),
                "seconds": secs,
            }
        )
    _print(rows)
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    from tidal.cli.bench import print_table

    print_table(
        [
            {
                "policy": r["policy"],
                "light_share": f"{r['light_share']:.3f}",
                "fair_share": f"{r['light_fair_share']:.3f}",
                "light_p95_s": f"{r['light_ttft_p95_s']:.2f}" if r["light_ttft_p95_s"] is not None else "-",
                "alone_p95_s": f"{r['light_alone_ttft_p95_s']:.2f}" if r["light_alone_ttft_p95_s"] else "-",
                "vs_alone": f"{r['light_ttft_vs_alone']:.2f}x"
                if r["light_ttft_vs_alone"] is not None
                else "-",
                "light_refused": f"{r['light_refused']}/{r['light_offered']}",
                "heavy_served": r["heavy_served"],
                "heavy_refused": r["heavy_refused"],
            }
            for r in rows
        ]
    )
