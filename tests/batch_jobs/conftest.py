"""The store runs on SQLite (default) and PostgreSQL (by URL): tests that touch it run on both,
each on its own throwaway database (maintenance sweeps look at every batch in it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.batch_tier import postgres_database, require_postgres


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tidal.db'}"
        return
    require_postgres()
    with postgres_database() as url:
        yield url
