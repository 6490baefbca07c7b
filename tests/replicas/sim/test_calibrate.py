"""Every published calibration point within 15%, except the documented exceptions."""

from __future__ import annotations

from tidal.replicas.sim.calibrate import POINTS, TOLERANCE_PCT, run_calibration


def test_every_calibration_point_is_within_tolerance_or_explained() -> None:
    rows = run_calibration()
    assert len(rows) == len(POINTS) >= 25
    outside = [r for r in rows if abs(r.error_pct) > TOLERANCE_PCT and not r.note]
    assert not outside, "\n".join(
        f"{r.point}: published {r.published}, simulated {r.simulated:.4g} ({r.error_pct:+.1f}%)"
        for r in outside
    )
    # Exceptions are few and each says why.
    noted = [r for r in rows if r.note]
    assert len(noted) <= 6 and all(len(r.note) > 20 for r in noted)
