"""The canary's eval runner: the ``eval`` job kind's scores on a group's replicas, and its bounds.

Scores are checked on real ``tidal sim`` replicas with an answer key; the registry is an
in-memory list of them (what ``GET /admin/replicas`` would answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.harness import ADMIN_KEY, run_gateway
from tests.batch_tier import (
    postgres_database,
    require_postgres,
    require_rabbitmq,
    running_tier,
    tiny_fleet,
)
from tests.scheduler.processes import sim_replicas, write_eval_files
from tidal.replicas.launcher import ReplicaProcess, free_port
from tidal.replicas.words import COMMON_WORDS
from tidal.scheduler.evals import EvalError, JobEvalRunner, ReplicaEvalRunner
from tidal.scheduler.signals import ReplicaView

pytestmark = pytest.mark.anyio

ITEMS = [(f"Name the two words of item {i}.", f"{COMMON_WORDS[i]} {COMMON_WORDS[-1 - i]}") for i in range(20)]


class Listing:
    def __init__(self, *views: ReplicaView) -> None:
        self.views = list(views)

    async def replicas(self) -> list[ReplicaView]:
        return self.views


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_eval_files(tmp_path_factory.mktemp("evals"), ITEMS)


@pytest.fixture(scope="module")
def sims(
    files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ReplicaProcess]]:
    key = ["--answer-key", str(files[1])]
    args = {"right": key, "half": [*key, "--accuracy", "0.5"], "broken": [*key, "--error-rate", "1.0"]}
    with sim_replicas(tmp_path_factory.mktemp("eval-sims"), args) as procs:
        yield procs


def runner(
    listing: Listing, dataset: Path, *, max_items: int = 1000, request_timeout_s: float = 30.0
) -> ReplicaEvalRunner:
    return ReplicaEvalRunner(
        listing,
        dataset,
        models={"p": "tiny"},
        options={"scorer": "exact", "max_tokens": 8},
        max_items=max_items,
        request_timeout_s=request_timeout_s,
    )


async def test_each_group_is_scored_on_its_own_replicas_only(
    files: tuple[Path, Path], sims: dict[str, ReplicaProcess]
) -> None:
    listing = Listing(
        ReplicaView("r", sims["right"].url, "p", group="stable"),
        ReplicaView("h", sims["half"].url, "p", group="canary"),
        # an unhealthy or draining replica of the group is not asked
        ReplicaView("b", sims["broken"].url, "p", group="canary", healthy=False),
        ReplicaView("b2", sims["broken"].url, "p", group="canary", draining=True),
    )
    evals = runner(listing, files[0])
    assert await evals.score("p", "stable") == 1.0
    report = await evals.report("p", "canary")
    assert (report["n"], report["failed"], report["replica_group"]) == (20, 0, "canary")
    assert 0.2 <= report["score"] <= 0.8 and report["ci95"][0] < report["score"] < report["ci95"][1]


async def test_an_eval_that_cannot_run_raises_instead_of_scoring(
    files: tuple[Path, Path], sims: dict[str, ReplicaProcess]
) -> None:
    listing = Listing(
        ReplicaView("b", sims["broken"].url, "p", group="canary"),
        ReplicaView("dead", f"http://127.0.0.1:{free_port()}", "p", group="gone"),
    )
    evals = runner(listing, files[0], request_timeout_s=2.0)
    with pytest.raises(EvalError, match="20 of 20 items got no answer"):
        await evals.score("p", "canary")  # every request answered 500
    with pytest.raises(EvalError, match="no answer"):
        await evals.score("p", "gone")  # connection refused
    with pytest.raises(EvalError, match="no healthy replica"):
        await evals.score("p", "nobody")
    with pytest.raises(EvalError, match="no model"):
        await evals.score("other-pool", "canary")


def test_bad_datasets_and_options_are_refused_when_the_runner_is_made(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    listing = Listing()
    with pytest.raises(ValueError, match="more than 5 items"):
        runner(listing, files[0], max_items=5)
    with pytest.raises(ValueError, match="max_items"):
        runner(listing, files[0], max_items=10**6)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no reference"}\n')
    with pytest.raises(ValueError, match="reference"):
        runner(listing, bad)
    with pytest.raises(ValueError, match="judge"):
        ReplicaEvalRunner(listing, files[0], models={}, options={"scorer": "judge", "judge_model": "tiny"})
    with pytest.raises(ValueError, match="options"):
        ReplicaEvalRunner(listing, files[0], models={}, options={"scorer": "psychic"})
    with pytest.raises(ValueError, match="from score"):
        ReplicaEvalRunner(listing, files[0], models={}, options={"replica_group": "canary"})
    with pytest.raises(ValueError, match="http"):
        JobEvalRunner("file:///etc", admin_key="k", dataset=files[0], models={})
    with pytest.raises(ValueError, match="options"):
        JobEvalRunner("http://127.0.0.1:1", admin_key="k", dataset=files[0], models={}, options={"top_k": 3})


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_the_eval_job_through_the_gateway_scores_each_group_as_the_direct_runner_does(
    files: tuple[Path, Path], sims: dict[str, ReplicaProcess], tmp_path: Path
) -> None:
    require_rabbitmq()
    require_postgres()
    # Given a batch tier (gateway process, worker, RabbitMQ, PostgreSQL) whose batch pool holds a
    # stable and a canary group
    fleet = tiny_fleet([sims["right"].url])
    fleet["pools"]["batch"]["replicas"] = [
        {"name": "stable-0", "url": sims["right"].url, "group": "stable"},
        {"name": "canary-0", "url": sims["half"].url, "group": "canary"},
    ]
    with postgres_database() as db, running_tier(tmp_path, db, fleet) as tier:
        tier.start_worker("reserved", concurrency=4)
        with run_gateway(tmp_path, fleet, env=tier.env()) as gw:
            jobs = JobEvalRunner(
                gw.url,
                admin_key=ADMIN_KEY,
                dataset=files[0],
                models={"batch": "tiny"},
                options={"scorer": "exact", "max_tokens": 8},
                poll_s=0.5,
                timeout_s=90,
            )
            # When both groups are evaluated as jobs pinned to them
            stable, canary = await asyncio.gather(
                jobs.report("batch", "stable"), jobs.report("batch", "canary")
            )
    # Then each job ran on its group's replica only and scored as the direct runner does
    direct = runner(
        Listing(
            ReplicaView("s", sims["right"].url, "p", group="stable"),
            ReplicaView("c", sims["half"].url, "p", group="canary"),
        ),
        files[0],
    )
    assert (stable["replica_group"], stable["score"], stable["n"]) == ("stable", 1.0, 20)
    assert canary["replica_group"] == "canary" and 0.2 <= canary["score"] <= 0.8
    assert canary["score"] == await direct.score("p", "canary")
