"""``tidal plan compare``: the eval job kind on two builds, beside their capacity and cost.

The builds are real ``tidal sim`` replicas answering from an answer key (one of them right only
half the time, as a quantisation that broke the model would be); their capacity comes from the
planner's replays of the 8B preset in BF16 and FP8.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.scheduler.plan.workloads import write_profile
from tests.scheduler.processes import sim_replicas, write_eval_files
from tidal.cli import cli
from tidal.replicas.launcher import ReplicaProcess
from tidal.replicas.words import COMMON_WORDS
from tidal.scheduler.plan.compare import _recommend, newcombe_interval

ITEMS = [(f"Name the two words of item {i}.", f"{COMMON_WORDS[i]} {COMMON_WORDS[-1 - i]}") for i in range(40)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_eval_files(tmp_path_factory.mktemp("evals"), ITEMS)


@pytest.fixture(scope="module")
def sims(
    files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ReplicaProcess]]:
    key = ["--answer-key", str(files[1])]
    with sim_replicas(
        tmp_path_factory.mktemp("sims"), {"right": key, "half": [*key, "--accuracy", "0.5"]}
    ) as p:
        yield p


def test_a_build_that_loses_score_is_not_worth_its_savings(
    files: tuple[Path, Path], sims: dict[str, ReplicaProcess], tmp_path: Path
) -> None:
    # Given BF16 replicas that answer the eval right and FP8 ones right half the time
    profile = write_profile(tmp_path, duration_s=120)
    result = CliRunner().invoke(
        cli,
        [
            "plan", "compare", "--model", "llama-3.1-8b", "--gpu", "h100", "--dataset", str(files[0]),
            "--served-model", "tiny", "--max-tokens", "8", "--profile", str(profile), "--quick", "--json",
            "--build", f"bf16:weights=bf16,url={sims['right'].url}",
            "--build", f"fp8:weights=fp8,url={sims['half'].url}",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    base, cand = d["builds"]
    # When both are evaluated with the eval job kind and measured by the planner
    assert base["score"] == 1.0 and base["items"] == 40 and base["failed"] == 0
    assert 0.2 < cand["score"] < 0.8
    # Then FP8 carries more and costs less per token, but loses score: keep BF16, saying why
    assert cand["requests_per_s_at_slo"] > base["requests_per_s_at_slo"]
    assert d["cost_ratio"] < 1.0 < d["capacity_ratio"]
    assert d["score_difference"] == pytest.approx(cand["score"] - 1.0)
    assert d["score_difference_ci95"][1] < 0  # a real drop, not noise
    assert d["recommendation"] == "bf16"
    assert "fp8 loses" in d["reason"] and "eval score" in d["reason"]


def _row(label: str, score: float, ci: tuple[float, float], rps: float, cost: float) -> dict[str, Any]:
    return {
        "label": label,
        "score": score,
        "ci95": list(ci),
        "requests_per_s_at_slo": rps,
        "cost_per_million_tokens": cost,
    }


@pytest.mark.parametrize(
    ("cand", "expected", "says"),
    [
        # cheaper, same score: take it (the interval is narrow enough to tell)
        (_row("fp8", 0.90, (0.89, 0.91), 2.0, 0.5), "fp8", "within 0.01"),
        # cheaper, same score, but the eval set is too small to rule out a larger drop
        (_row("fp8", 0.90, (0.80, 0.96), 2.0, 0.5), "fp8", "evaluate on more items"),
        # cheaper, loses 0.05: keep the baseline
        (_row("fp8", 0.85, (0.84, 0.86), 2.0, 0.5), "bf16", "fp8 loses 0.050"),
        # not cheaper, not better
        (_row("fp8", 0.90, (0.89, 0.91), 1.0, 1.2), "bf16", "not cheaper"),
        # not cheaper but better
        (_row("fp8", 0.95, (0.94, 0.96), 1.0, 1.2), "fp8", "better"),
    ],
)
def test_the_recommendation_weighs_score_against_cost(
    cand: dict[str, object], expected: str, says: str
) -> None:
    base = _row("bf16", 0.90, (0.89, 0.91), 1.0, 1.0)
    lo, hi = cand["ci95"]
    ci = newcombe_interval((0.90, 0.89, 0.91), (cand["score"], lo, hi))
    label, reason = _recommend(base, cand, 0.01, ci)
    assert label == expected
    assert says in reason


def test_newcombe_interval_of_a_difference() -> None:
    lo, hi = newcombe_interval((0.5, 0.4, 0.6), (0.7, 0.6, 0.8))
    assert lo == pytest.approx(0.2 - (0.1**2 + 0.1**2) ** 0.5)
    assert hi == pytest.approx(0.2 + (0.1**2 + 0.1**2) ** 0.5)
