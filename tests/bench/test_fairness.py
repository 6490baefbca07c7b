"""The fairness benchmark, briefly: in a saturated pool the light tenant gets its fair share and
nearly its lone TTFT under fair share, and neither under FIFO; both rows carry the contract."""

from __future__ import annotations

from pathlib import Path

from tidal.bench.fairness import run

CONTRACT = {"policy", "light_share", "light_fair_share", "light_ttft_p95_s", "light_alone_ttft_p95_s"}


def test_fair_share_gives_the_light_tenant_its_share_and_fifo_does_not(tmp_path: Path) -> None:
    rows = {r["policy"]: r for r in run(quick=True, out_dir=tmp_path, seconds=60)}
    assert set(rows) == {"fair", "fifo"}
    for r in rows.values():
        assert set(r) >= CONTRACT
    fair, fifo = rows["fair"], rows["fifo"]
    assert fair["light_share"] >= 0.98 * fair["light_fair_share"] and fair["light_refused"] == 0
    assert fair["light_ttft_p95_s"] <= 1.3 * fair["light_alone_ttft_p95_s"]
    assert fifo["light_share"] < 0.9 * fifo["light_fair_share"]
    assert fifo["light_ttft_p95_s"] > 3 * fair["light_ttft_p95_s"]
    # Work-conserving: the pool answers about as much either way.
    total = {p: r["light_served"] + r["heavy_served"] for p, r in rows.items()}
    assert total["fair"] >= 0.9 * total["fifo"]
