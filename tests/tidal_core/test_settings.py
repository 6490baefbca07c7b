from __future__ import annotations

import pytest
from pydantic import ValidationError

from tidal.settings import Settings


def test_development_defaults_are_usable() -> None:
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.resolved_database_url.startswith("sqlite:///")


def test_production_refuses_unsafe_defaults() -> None:
    with pytest.raises(ValidationError, match="TIDAL_ADMIN_KEY"):
        Settings(_env_file=None, environment="production")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="TIDAL_FLOWER_BASIC_AUTH"):
        Settings(_env_file=None, environment="production", admin_key="x" * 20)  # type: ignore[call-arg]
    ok = Settings(
        _env_file=None,
        environment="production",
        admin_key="x" * 20,  # type: ignore[call-arg]
        flower_basic_auth="ops:long-random",
        database_url="postgresql+psycopg://h/db",
    )
    assert ok.environment == "production"
