"""The mixed soak, briefly: the whole platform (``tidal up``) serving chat while batches, jobs
and a canary rollout run through it; nothing is a 5xx, every batch line is answered exactly once,
every job completes, the rollout decides while the canary serves users, memory stays flat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.batch_tier import require_rabbitmq
from tidal.bench.mixed_soak import run

pytestmark = pytest.mark.slow


def test_chat_batches_jobs_and_a_canary_share_the_platform(tmp_path: Path) -> None:
    require_rabbitmq()
    result = run(quick=True, out_dir=tmp_path, seconds=45)
    json.dumps(result)  # what `tidal bench mixed-soak` writes
    assert result["checks"] == dict.fromkeys(result["checks"], True), json.dumps(result, indent=1)
    assert result["batches"]["lines"] >= 80 and result["jobs"]["by_kind"].keys() == {
        "summaries",
        "embedding_backfill",
    }
    assert result["chat"][-1]["admitted"] > 100
