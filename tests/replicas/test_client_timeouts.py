"""The replica client's raw requests always have a deadline: a call that names no timeout gets the
client's own (connect, and each read), never none at all."""

from __future__ import annotations

import asyncio

import pytest

from tidal.replicas.client import ReplicaClient
from tidal.replicas.errors import ReplicaTimeout

pytestmark = pytest.mark.anyio


async def test_a_request_without_a_timeout_still_ends_on_an_upstream_that_never_answers() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing, keeps the connection open

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = ReplicaClient(f"http://127.0.0.1:{port}", name="silent", read_timeout=0.3)
    try:
        with pytest.raises(ReplicaTimeout):
            # (without the client's timeout this waits forever; the outer bound only fails the test)
            await asyncio.wait_for(_get(client), 10)
        assert accepted
    finally:
        await client.aclose()
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


async def _get(client: ReplicaClient) -> None:
    async with client.open("GET", "/v1/models") as resp:
        await resp.read()
