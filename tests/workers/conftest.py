"""Batch-tier execution tests run on the session's real vLLM CPU replicas (``vllm_pair``),
which they share and never kill or pause. ``TIDAL_TEST_VLLM_URLS`` (comma-separated) points them at
replicas already running instead, for quick local iterations."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def vllm_urls(request: pytest.FixtureRequest) -> list[str]:
    given = os.environ.get("TIDAL_TEST_VLLM_URLS")
    if given:
        return [u.strip() for u in given.split(",") if u.strip()]
    return [p.url for p in request.getfixturevalue("vllm_pair")]
