"""Each chaos test's outcome, for ``tidal bench chaos`` (``TIDAL_CHAOS_REPORT`` names the file)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

_outcomes: dict[str, str] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report: Any = yield
    if report.when == "call" or report.failed:
        _outcomes[item.nodeid] = (
            "passed" if report.passed and _outcomes.get(item.nodeid) != "failed" else "failed"
        )
        path = os.environ.get("TIDAL_CHAOS_REPORT")
        if path:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(_outcomes, fh)
    return report  # type: ignore[no-any-return]
