"""A gateway whose replicas do not answer: for what must be refused before any replica is reached."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.harness import Gateway, fleet_dict, run_gateway

DEAD_REPLICA = "http://127.0.0.1:9"  # nothing listens on the discard port: connection refused


@pytest.fixture(scope="session")
def offline_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    fleet = fleet_dict([DEAD_REPLICA], adapters={"support-v1": "/nonexistent/adapter"})
    with run_gateway(tmp_path_factory.mktemp("gw-offline"), fleet) as gw:
        yield gw
