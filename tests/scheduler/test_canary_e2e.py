"""Canary rollout end to end: ``tidal sim`` replicas behind a real gateway process, the controller
driving router weights through ``/admin``, the eval job kind scoring each group, and users'
requests flowing through the gateway (the ``openai`` SDK) the whole time.

A stable build answers the eval set right; a canary build is registered at run time in group
``canary``. A build that answers wrong (``--accuracy 0.3``) or fails requests (``--error-rate
0.2``) is rolled back; a good one is promoted, and the stable group serves its share until then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.harness import ADMIN_KEY, Gateway, fleet_dict, run_gateway
from tests.batch_tier import (
    postgres_database,
    require_postgres,
    require_rabbitmq,
    running_tier,
    tiny_fleet,
)
from tests.scheduler.processes import Traffic, sim_replicas, write_eval_files
from tidal.clock import SystemClock
from tidal.replicas.launcher import ReplicaProcess
from tidal.replicas.words import COMMON_WORDS
from tidal.scheduler.canary import CanaryController, CanarySpec, CanaryState, EvalRunner
from tidal.scheduler.evals import JobEvalRunner, ReplicaEvalRunner
from tidal.scheduler.gateway import GatewayAdmin

pytestmark = pytest.mark.anyio

# Answers of vocabulary words: the simulated replica's tokenizer gives those fixed ids, so an
# answer-key answer comes back exactly (made-up words are hashed and may collide).
ITEMS = [
    (f"Which two words are the answer to question {i}?", f"{COMMON_WORDS[i]} {COMMON_WORDS[-1 - i]}")
    for i in range(40)
]
SPEC = CanarySpec(
    steps=(0.25, 0.5),
    step_s=2.0,
    min_requests=15,
    min_requests_to_judge=20,
    max_error_rate_increase=0.05,
    max_eval_drop=0.05,
    eval_timeout_s=20.0,
)
EVAL_OPTIONS = {"scorer": "exact", "max_tokens": 16}
BUILDS = {
    "stable": [],
    "stable-b": [],
    "wrong": ["--accuracy", "0.3"],
    "failing": ["--error-rate", "0.2"],
    "good": [],
}


@pytest.fixture(scope="module")
def eval_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_eval_files(tmp_path_factory.mktemp("canary-eval"), ITEMS)


@pytest.fixture(scope="module")
def builds(
    eval_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ReplicaProcess]]:
    key = str(eval_files[1])
    args = {name: ["--answer-key", key, *extra] for name, extra in BUILDS.items()}
    with sim_replicas(tmp_path_factory.mktemp("canary-sims"), args) as procs:
        yield procs


@pytest.fixture
def gateway(builds: dict[str, ReplicaProcess], tmp_path: Path) -> Iterator[Gateway]:
    # Two replicas of the stable build in the fleet config (replica-0 and replica-1, group
    # "stable"); each test registers its canary, one replica.
    with run_gateway(tmp_path, fleet_dict([builds["stable"].url, builds["stable-b"].url])) as gw:
        yield gw


async def _rollout(
    gw: Gateway, canary: ReplicaProcess | None, dataset: Path, evals: EvalRunner | None = None
) -> tuple[CanaryController, list[tuple[CanaryState, dict[str, float]]], Traffic, dict[str, float]]:
    """Register the canary (unless the fleet config lists it), run the controller to its end under
    traffic with ``evals`` (default: the direct runner); returns the controller, what a watcher saw
    every 0.2 s (state, weights), the traffic, and group requests at the end."""
    traffic = Traffic(gw, [p for p, _ in ITEMS])
    async with GatewayAdmin([gw.url], admin_key=ADMIN_KEY) as admin:
        if canary is not None:
            await admin.register("canary-0", canary.url, "interactive", group="canary", weight=0.0)
        evals = evals or ReplicaEvalRunner(
            admin, dataset, models={"interactive": "tiny"}, options=EVAL_OPTIONS
        )
        ctl = CanaryController(
            admin, admin, pool="interactive", clock=SystemClock(), spec=SPEC, evals=evals, interval_s=0.25
        )
        seen: list[tuple[CanaryState, dict[str, float]]] = []

        async def watch() -> None:
            while True:
                state = ctl.state  # read before the weights: a PROMOTED here means it already moved
                views = await admin.replicas()
                seen.append((state, {v.name: v.weight if v.healthy else -1.0 for v in views}))
                await asyncio.sleep(0.2)

        traffic.start()
        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait_for(ctl.run(), 30)
        finally:
            watcher.cancel()
            await traffic.aclose()
        groups = {name: g.requests for name, g in (await admin.load()).groups.items()}
    return ctl, seen, traffic, groups


async def _requests_by_group(gw: Gateway) -> dict[str, float]:
    async with GatewayAdmin([gw.url], admin_key=ADMIN_KEY) as admin:
        return {name: g.requests for name, g in (await admin.load()).groups.items()}


@pytest.mark.parametrize(
    ("build", "reason"),
    [("wrong", "eval_score"), ("failing", "error_rate")],
)
async def test_a_worse_build_is_rolled_back_automatically(
    gateway: Gateway,
    builds: dict[str, ReplicaProcess],
    eval_files: tuple[Path, Path],
    build: str,
    reason: str,
) -> None:
    # Given a stable group and a worse canary build under user traffic
    t0 = time.monotonic()
    ctl, seen, traffic, groups = await _rollout(gateway, builds[build], eval_files[0])
    took = time.monotonic() - t0

    # Then the controller rolls it back, for the reason the build is worse
    assert ctl.state is CanaryState.ROLLED_BACK, ctl.reason
    assert ctl.reason.startswith(reason + ":"), ctl.reason
    assert any(w.get("canary-0", 0) > 0 for _, w in seen), "the canary never got a share"
    # with the weights of a rollback: canary 0, stable restored
    async with GatewayAdmin([gateway.url], admin_key=ADMIN_KEY) as admin:
        weights = {v.name: v.weight for v in await admin.replicas()}
    assert weights == {"replica-0": 1.0, "replica-1": 1.0, "canary-0": 0.0}
    # and users never saw an error: a canary failure before the first token is retried on stable
    assert traffic.failed == [], traffic.failed[:3]
    # And afterwards no request reaches the canary
    after = Traffic(gateway, [p for p, _ in ITEMS])
    await after.send(40)
    await after.aclose()
    now = await _requests_by_group(gateway)
    assert now["canary"] == groups["canary"] and now["stable"] >= groups["stable"] + 40
    print(
        f"\ncanary {build}: rolled back after {took:.1f} s ({ctl.reason}); "
        f"eval scores (stable, canary) = {ctl.eval_scores}; "
        f"user requests {traffic.ok} ok, {len(traffic.failed)} failed"
    )


async def test_a_good_build_is_promoted_and_stable_serves_until_then(
    gateway: Gateway, builds: dict[str, ReplicaProcess], eval_files: tuple[Path, Path]
) -> None:
    t0 = time.monotonic()
    ctl, seen, traffic, groups = await _rollout(gateway, builds["good"], eval_files[0])
    took = time.monotonic() - t0

    assert ctl.state is CanaryState.PROMOTED, ctl.reason
    assert ctl.eval_scores == (1.0, 1.0)
    assert took >= SPEC.step_s * len(SPEC.steps)  # every step was held
    # The stable replica was up and had weight in every sample taken before the promotion
    before = [w for state, w in seen if state is not CanaryState.PROMOTED]
    assert before and all(w["replica-0"] > 0 and w["replica-1"] > 0 for w in before), before
    # and the canary's share of the weight went through the steps (2 stable replicas, 1 canary)
    shares = sorted(
        {round(w["canary-0"] / (w["canary-0"] + w["replica-0"] + w["replica-1"]), 2) for w in before}
    )
    assert set(shares) >= {0.25, 0.5}, shares
    assert groups["stable"] > 0 and groups["canary"] > 0
    # After it: canary weight 1, stable 0, and all new traffic goes to the canary
    async with GatewayAdmin([gateway.url], admin_key=ADMIN_KEY) as admin:
        weights = {v.name: v.weight for v in await admin.replicas()}
    assert weights == {"replica-0": 0.0, "replica-1": 0.0, "canary-0": 1.0}
    assert traffic.failed == [], traffic.failed[:3]
    after = Traffic(gateway, [p for p, _ in ITEMS])
    await after.send(40)
    await after.aclose()
    now = await _requests_by_group(gateway)
    assert now["stable"] == groups["stable"] and now["canary"] >= groups["canary"] + 40
    print(
        f"\ncanary good: promoted after {took:.1f} s ({ctl.reason}); "
        f"user requests {traffic.ok} ok, {len(traffic.failed)} failed"
    )


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_the_eval_can_run_as_an_eval_job_of_the_batch_tier(
    builds: dict[str, ReplicaProcess], eval_files: tuple[Path, Path], tmp_path: Path
) -> None:
    require_rabbitmq()
    require_postgres()
    # Given both builds in the fleet config (the canary at weight 0), which the batch tier's
    # workers read too, and a gateway serving users and the jobs API
    fleet = tiny_fleet([builds["stable"].url])
    fleet["pools"]["interactive"]["replicas"] = [
        {"name": "replica-0", "url": builds["stable"].url},
        {"name": "canary-0", "url": builds["wrong"].url, "group": "canary", "weight": 0.0},
    ]
    fleet["features"]["default"] = {"class": "interactive", "context_cap": 4096}  # users' requests
    with postgres_database() as db, running_tier(tmp_path, db, fleet) as tier:
        tier.start_worker("reserved", concurrency=4)
        with run_gateway(tmp_path, fleet, env=tier.env()) as gw:
            jobs = JobEvalRunner(
                gw.url,
                admin_key=ADMIN_KEY,
                dataset=eval_files[0],
                models={"interactive": "tiny"},
                options=EVAL_OPTIONS,
                poll_s=0.5,
                timeout_s=25,
            )
            # When the controller scores the groups with eval jobs
            t0 = time.monotonic()
            ctl, _, traffic, _ = await _rollout(gw, None, eval_files[0], evals=jobs)
            took = time.monotonic() - t0
            async with GatewayAdmin([gw.url], admin_key=ADMIN_KEY) as admin:
                views = await admin.replicas()
                weights = {v.name: v.weight for v in views if v.pool == "interactive"}
    # Then the worse build is rolled back on the jobs' scores
    assert ctl.state is CanaryState.ROLLED_BACK and ctl.reason.startswith("eval_score:"), ctl.reason
    assert ctl.eval_scores is not None and ctl.eval_scores[0] == 1.0 and ctl.eval_scores[1] < 0.6
    assert weights == {"replica-0": 1.0, "canary-0": 0.0}
    assert traffic.failed == []
    print(f"\ncanary wrong, eval as jobs: rolled back after {took:.1f} s ({ctl.reason})")
