"""Where a chunk's lines go: the lane's pools (or the pinned one), those of the batch's model
first, and never a pool outside the regions of the batch's feature."""

from __future__ import annotations

from typing import Any

import pytest

from tidal.fleet import parse_fleet
from tidal.workers.runtime import chunk_pools

FLEET = parse_fleet(
    {
        "models": [{"name": "m"}, {"name": "e", "embedding": True}],
        "pools": {
            "us-batch": {"kind": "batch", "model": "m", "region": "us-east"},
            "eu-batch": {"kind": "batch", "model": "m", "region": "eu-west"},
            "eu-embed": {"kind": "batch", "model": "e", "region": "eu-west"},
            "nowhere-batch": {"kind": "batch", "model": "m"},
            "us-spot": {"kind": "spot", "model": "m", "region": "us-east"},
            "eu-chat": {"kind": "interactive", "model": "m", "region": "eu-west", "shared": True},
        },
    }
)
EU = frozenset({"eu-west"})

CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "no regions: every pool of the lane",
        {"lane": "reserved"},
        ["us-batch", "eu-batch", "eu-embed", "nowhere-batch"],
    ),
    (
        "regions: only the lane's pools inside them",
        {"lane": "reserved", "regions": EU},
        ["eu-batch", "eu-embed"],
    ),
    (
        "regions and a model: its pools there first",
        {"lane": "reserved", "regions": EU, "model": "e"},
        ["eu-embed"],
    ),
    ("a lane with no pool there: none, the chunk waits", {"lane": "spot", "regions": EU}, []),
    (
        "an all worker borrows only pools inside",
        {"lane": "spot", "worker_lane": "all", "regions": EU},
        ["eu-batch", "eu-embed"],
    ),
    ("a pinned pool outside: none", {"lane": "reserved", "pool": "us-batch", "regions": EU}, []),
    ("a pinned pool inside", {"lane": "reserved", "pool": "eu-batch", "regions": EU}, ["eu-batch"]),
    ("the shared lane's borrowed pool inside", {"lane": "shared", "regions": EU}, ["eu-chat"]),
]


@pytest.mark.parametrize(("case", "kw", "want"), CASES, ids=[c[0] for c in CASES])
def test_chunk_pools(case: str, kw: dict[str, Any], want: list[str]) -> None:
    kw.setdefault("worker_lane", kw["lane"])
    assert [p.name for p in chunk_pools(FLEET, **kw)] == want
