"""Load reports and the gateway admin client (over real HTTP against a contract-shaped server)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tidal.scheduler.gateway import GatewayAdmin, GatewayError, merge_reports
from tidal.scheduler.signals import GroupLoad, LoadReport, PoolLoad, ReplicaView, SignalError

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("body", "expect"),
    [
        ({"time": 5, "pools": {"p": {"queue_wait_p95_s": 0.4}}}, 0.4),
        ({"time": 5, "pools": {"p": {"queue_wait_p95_s": None}}}, 0.0),  # no data in the window
        ({"time": 5, "pools": {"p": {"queue_wait_p95_s": 0.4, "something_new": "x"}}}, 0.4),
        ({"time": 5, "pools": {"p": {}}}, 0.0),
    ],
)
def test_a_load_report_reads_what_it_knows(body: dict[str, Any], expect: float) -> None:
    assert LoadReport.from_json(body).pools["p"].queue_wait_p95_s == expect


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"pools": []},
        {"pools": {"p": {"queue_wait_p95_s": "slow"}}},
        {"pools": {"p": {"kv_cache_usage_max": -1}}},
        {"pools": {"p": {"kv_cache_usage_max": float("inf")}}},
        {"pools": {"p": {"inflight": True}}},
        {"pools": {f"p{i}": {} for i in range(5000)}},
        {"groups": {"canary": 3}},
    ],
)
def test_a_broken_load_report_is_refused_not_read_as_calm(body: Any) -> None:
    with pytest.raises(SignalError):
        LoadReport.from_json(body)


def test_merging_gateways_takes_the_worst_wait_and_adds_counts() -> None:
    a = LoadReport(
        1.0,
        {
            "p": PoolLoad(
                queue_depth=2, queue_wait_p95_s=0.1, kv_cache_usage_max=0.5, requests_per_s=10, error_rate=0.0
            )
        },
    )
    b = LoadReport(
        2.0,
        {
            "p": PoolLoad(
                queue_depth=3, queue_wait_p95_s=0.7, kv_cache_usage_max=0.4, requests_per_s=30, error_rate=0.1
            )
        },
    )
    m = merge_reports([a, b])
    p = m.pools["p"]
    assert (m.time, p.queue_depth, p.queue_wait_p95_s, p.kv_cache_usage_max) == (2.0, 5, 0.7, 0.5)
    assert p.requests_per_s == 40 and p.error_rate == pytest.approx(0.075)


def test_gateways_that_share_load_state_are_not_counted_once_each() -> None:
    # Given two gateways sharing load state (each report counts the fleet: 10 + 30 req/s, 5
    # queued, 8 in flight; one read the other's counts a little later) and one that does not,
    def pool(queued: float, inflight: float, rps: float, errors: float) -> PoolLoad:
        return PoolLoad(queue_depth=queued, inflight=inflight, requests_per_s=rps, error_rate=errors / rps)

    shared_a = LoadReport(1.0, {"p": pool(5, 8, 40, 3)}, scope="fleet")
    shared_b = LoadReport(1.1, {"p": pool(4, 8, 38, 3)}, scope="fleet")
    alone = LoadReport(1.2, {"p": pool(1, 2, 6, 0)})
    # When the scheduler merges what it polled,
    m = merge_reports([shared_a, shared_b, alone])
    p = m.pools["p"]
    # Then the sharing gateways count once (the largest of their counts), the other adds its own.
    assert (p.queue_depth, p.inflight, p.requests_per_s) == (6, 10, 46)
    assert p.error_rate == pytest.approx(3 / 46)
    assert merge_reports([shared_a, shared_b]).pools["p"].requests_per_s == 40
    # and a report says which it is (anything else than "fleet" counts as one gateway's).
    assert LoadReport.from_json({"time": 1, "scope": "fleet", "pools": {}}).scope == "fleet"
    assert LoadReport.from_json({"time": 1, "scope": "x", "pools": {}}).scope == "gateway"


def test_a_groups_fleet_wide_counts_count_once_whatever_the_pools_scope() -> None:
    # Given two gateways whose canary counts are the fleet's (one of them cut off from the
    # others' load for now, its group counts still the fleet's) and one counting its own,
    shared_a = LoadReport(
        1.0, groups={"canary": GroupLoad(100, 4, 0.04)}, scope="fleet", groups_scope="fleet"
    )
    shared_b = LoadReport(1.1, groups={"canary": GroupLoad(98, 4, 0.04)}, groups_scope="fleet")
    alone = LoadReport(1.2, groups={"canary": GroupLoad(10, 1, 0.1)})
    # When merged, the fleet's counts count once (the largest) and the other's add.
    g = merge_reports([shared_a, shared_b, alone]).groups["canary"]
    assert (g.requests, g.errors) == (110, 5) and g.error_rate == pytest.approx(5 / 110)
    assert merge_reports([shared_a, shared_b]).groups_scope == "fleet"
    assert LoadReport.from_json({"time": 1, "groups_scope": "fleet"}).groups_scope == "fleet"


class FakeGateway:
    """Speaks the admin API contract; records what it was asked."""

    def __init__(self, key: str, load: dict[str, Any]) -> None:
        self.key = key
        self.load = load
        self.replicas: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, Any]] = []
        self.huge = False
        app = web.Application()
        app.router.add_get("/admin/load", self._load)
        app.router.add_get("/admin/replicas", self._list)
        app.router.add_post("/admin/replicas", self._register)
        app.router.add_patch("/admin/replicas/{name}", self._patch)
        app.router.add_delete("/admin/replicas/{name}", self._delete)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def _auth(self, request: web.Request) -> None:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            raise web.HTTPUnauthorized(
                text='{"error": {"message": "Incorrect API key provided."}}', content_type="application/json"
            )

    async def _load(self, request: web.Request) -> web.StreamResponse:
        self._auth(request)
        if self.huge:
            return web.Response(body=b"{" + b" " * (9 * 1024 * 1024) + b"}", content_type="application/json")
        return web.json_response(self.load)

    async def _list(self, request: web.Request) -> web.Response:
        self._auth(request)
        return web.json_response({"data": list(self.replicas.values())})

    async def _register(self, request: web.Request) -> web.Response:
        self._auth(request)
        body = await request.json()
        self.calls.append(("POST", body["name"], body))
        if body["name"] in self.replicas:
            return web.json_response({"error": {"message": "exists"}}, status=409)
        self.replicas[body["name"]] = {**body, "healthy": True, "draining": False, "inflight": 0}
        return web.json_response(self.replicas[body["name"]], status=201)

    async def _patch(self, request: web.Request) -> web.Response:
        self._auth(request)
        name = request.match_info["name"]
        body = await request.json()
        self.calls.append(("PATCH", name, body))
        if name not in self.replicas:
            return web.json_response({"error": {"message": f"no replica {name}"}}, status=404)
        self.replicas[name].update(body)
        return web.json_response(self.replicas[name])

    async def _delete(self, request: web.Request) -> web.Response:
        self._auth(request)
        name = request.match_info["name"]
        self.calls.append(("DELETE", name, None))
        if self.replicas.pop(name, None) is None:
            return web.json_response({"error": {"message": "no such replica"}}, status=404)
        return web.Response(status=204)


@pytest.fixture
async def gateways() -> AsyncIterator[list[FakeGateway]]:
    gws = [
        FakeGateway(
            "k", {"time": 10, "pools": {"interactive": {"queue_wait_p95_s": 0.2, "requests_per_s": 5}}}
        ),
        FakeGateway(
            "k", {"time": 11, "pools": {"interactive": {"queue_wait_p95_s": 0.9, "requests_per_s": 7}}}
        ),
    ]
    for g in gws:
        await g.server.start_server()
    yield gws
    for g in gws:
        await g.server.close()


async def test_the_admin_client_merges_reads_and_writes_to_every_gateway(gateways: list[FakeGateway]) -> None:
    async with GatewayAdmin([g.url for g in gateways], admin_key="k") as gw:
        # Given two gateways; when the scheduler reads the load, it sees the worst wait and the total rate
        report = await gw.load()
        assert report.pools["interactive"].queue_wait_p95_s == 0.9
        assert report.pools["interactive"].requests_per_s == 12
        # When it registers, re-registers, marks unhealthy and deregisters a replica
        await gw.register("r1", "http://127.0.0.1:9001", "interactive", group="canary", weight=0.5)
        await gw.register("r1", "http://127.0.0.1:9001", "interactive")  # 409: already there, fine
        await gw.update("r1", healthy=False, weight=0.0)
        views = await gw.replicas()
        assert views == [
            ReplicaView("r1", "http://127.0.0.1:9001", "interactive", "canary", 0.0, False, False, 0.0)
        ]
        await gw.deregister("r1")
        await gw.deregister("r1")  # 404: already gone, fine
        # Then each gateway got every write
        for g in gateways:
            assert [(m, n) for m, n, _ in g.calls] == [
                ("POST", "r1"),
                ("POST", "r1"),
                ("PATCH", "r1"),
                ("DELETE", "r1"),
                ("DELETE", "r1"),
            ]
            assert g.calls[2][2] == {"healthy": False, "weight": 0.0}


async def test_one_gateway_down_still_gives_a_load_but_a_write_reports_the_failure(
    gateways: list[FakeGateway],
) -> None:
    urls = [g.url for g in gateways]
    await gateways[1].server.close()
    async with GatewayAdmin(urls, admin_key="k", timeout_s=1.0) as gw:
        assert (await gw.load()).pools["interactive"].queue_wait_p95_s == 0.2
        with pytest.raises(GatewayError, match="1 of 2"):
            await gw.register("r1", "http://127.0.0.1:9001", "interactive")


async def test_a_wrong_key_an_oversized_answer_and_a_bad_url_are_errors(gateways: list[FakeGateway]) -> None:
    async with GatewayAdmin([gateways[0].url], admin_key="wrong") as gw:
        with pytest.raises(GatewayError, match="Incorrect API key"):
            await gw.update("r1", healthy=False)
    gateways[0].huge = True
    async with GatewayAdmin([gateways[0].url], admin_key="k") as gw:
        with pytest.raises(GatewayError):
            await gw.load()
    for bad in ["ftp://x", "127.0.0.1:8000", "http://"]:
        with pytest.raises(ValueError):
            GatewayAdmin([bad], admin_key="k")


async def test_a_gateway_that_never_answers_is_an_error_after_the_timeout() -> None:
    # Given a gateway that accepts connections and never answers (the kernel completes the
    # handshake on the listening socket's backlog; nothing reads),
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        async with GatewayAdmin([url], admin_key="k", timeout_s=0.3) as gw:
            calls = {
                "load": gw.load,
                "replicas": gw.replicas,
                "register": lambda: gw.register("r1", "http://127.0.0.1:9001", "interactive"),
                "update": lambda: gw.update("r1", healthy=False),
            }
            for name, call in calls.items():
                # Then every call fails after the client's timeout instead of waiting forever.
                t0 = time.monotonic()
                with pytest.raises(GatewayError):
                    await asyncio.wait_for(call(), 5)
                assert time.monotonic() - t0 < 2, name
