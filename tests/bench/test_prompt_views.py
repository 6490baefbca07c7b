"""The routing benchmark reads a trace request as the live systems read the chat it stands for."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.harness import fleet_dict
from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.bench.prompt_views import block_text, conversations, prepare_views, trace_messages
from tidal.bench.traces import TraceRequest
from tidal.fleet import FleetConfig
from tidal.router.framework import Router
from tidal.router.prefix import MAX_BLOCKS, render_messages
from tidal.router.types import RouteRequest
from tidal.settings import Settings

# One conversation of three turns (each repeats the whole previous prompt, whose last block is
# partial), another that shares only the global first block, and a request without block ids.
WORKLOAD = [
    TraceRequest(0.0, 1100, 10, (0, 11, 12)),
    TraceRequest(1.0, 700, 10, (0, 21)),
    TraceRequest(5.0, 1700, 10, (0, 11, 13, 14)),
    TraceRequest(9.0, 2300, 10, (0, 11, 13, 15, 16)),
    TraceRequest(9.5, 900, 10, ()),
]


def test_turns_that_repeat_the_previous_prompt_are_one_conversation() -> None:
    sessions, bounds = conversations(WORKLOAD)
    assert sessions[0] == sessions[2] == sessions[3] != sessions[1]
    assert sessions[4] is None  # nothing says which conversation it belongs to
    # Each earlier turn ended where its full blocks did.
    assert bounds == [(), (), (2,), (2, 3), ()]
    # A workload that knows its sessions keeps them.
    own = [TraceRequest(0.0, 600, 5, (7, 8), session_id="s-1")]
    assert conversations(own)[0] == ["s-1"]


def test_a_later_turn_renders_as_the_earlier_turns_text_and_more() -> None:
    sessions, bounds = conversations(WORKLOAD)
    first, second, third = (trace_messages(WORKLOAD[i], bounds[i]) for i in (0, 2, 3))
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user"]
    assert first[0] == second[0] == third[0]  # the shared first block is the system message
    assert third[1] == second[1]  # the first user turn: the stable prefix key's input
    # The text of turn 2's full blocks is where turn 3's starts (the partial last block differs).
    full = "".join(block_text(h, 512) for h in (0, 11, 13))
    assert "".join(m["content"] for m in third).startswith(full)
    views = prepare_views(WORKLOAD)
    assert views[2].prefix_key == views[3].prefix_key != views[1].prefix_key
    assert views[3].live[: len(views[0].live) // 2] == views[0].live[: len(views[0].live) // 2]


def test_characters_per_token_vary_by_block_so_the_estimate_is_only_right_on_average() -> None:
    lengths = {len(block_text(h, 1000)) for h in range(200)}
    assert min(lengths) >= 3200 and max(lengths) <= 4800 and len(lengths) > 50
    assert block_text(5, 100) == block_text(5, 100) and block_text(5, 100) != block_text(6, 100)


def test_sglang_sees_the_whole_prompt_the_others_the_gateways_capped_blocks() -> None:
    long = TraceRequest(0.0, 20_000, 10, tuple(range(40)))
    (view,) = prepare_views([long])
    assert len(view.live) == MAX_BLOCKS
    assert len(view.full) == len(render_messages(trace_messages(long)).encode()) // 64 > MAX_BLOCKS
    assert view.full[:MAX_BLOCKS] == view.live


@pytest.fixture(scope="module")
def gateway() -> TestClient:
    keys = KeyStore()
    keys.add_key("dev-key", Principal("dev", frozenset({"*"})))
    fleet = FleetConfig.model_validate(fleet_dict(["http://127.0.0.1:9"]))
    return TestClient(create_app(fleet, Settings(_env_file=None), keys=keys))


def test_the_benchmark_and_the_live_gateway_build_the_same_route(
    gateway: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[RouteRequest] = []
    route = Router.route

    def spy(self: Router, request: RouteRequest, *args: Any, **kwargs: Any) -> Any:
        seen.append(request)
        return route(self, request, *args, **kwargs)

    monkeypatch.setattr(Router, "route", spy)
    sessions, bounds = conversations(WORKLOAD)
    views = prepare_views(WORKLOAD)
    for i, req in enumerate(WORKLOAD):
        seen.clear()
        headers = {"Authorization": "Bearer dev-key"}
        if views[i].session_key is not None:
            headers["X-Session-Id"] = views[i].session_key
        body = {"model": "tiny", "messages": trace_messages(req, bounds[i], unique=i), "max_tokens": 4}
        gateway.post("/v1/chat/completions", json=body, headers=headers)  # no replica answers
        assert seen, "the gateway routed the request"
        live = seen[0]
        assert live.prefix_key == views[i].prefix_key
        assert live.prefix_blocks == tuple(views[i].live)
        assert live.prompt_tokens == views[i].prompt_tokens
        assert live.session_key == views[i].session_key
