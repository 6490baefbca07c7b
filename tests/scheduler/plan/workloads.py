"""Small workloads for the planner's tests: profiles written to a temporary directory."""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["write_profile"]

CHAT = {
    "name": "test-chat",
    "duration_s": 240,
    "rate_rps": 8.0,
    "seed": 3,
    "shared_prefix_tokens": 512,
    "features": {
        "chat": {"share": 0.85, "prompt_tokens": [128, 2048], "output_tokens": [16, 200]},
        "rag": {"share": 0.15, "prompt_tokens": [4096, 48000], "output_tokens": [32, 200]},
    },
}


def write_profile(directory: Path, **changes: object) -> Path:
    """A profile of two features (``chat`` and the longer ``rag``), with ``changes`` applied."""
    path = directory / "profile.yaml"
    path.write_text(yaml.safe_dump({**CHAT, **changes}))
    return path
