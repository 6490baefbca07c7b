"""Three gateways route as one in front of real vLLM: shared load through Redis, cache state from
vLLM's own KV events.

Given two real vLLM CPU replicas publishing KV events (``--kv-events-config``), a Redis, and three
``tidal gateway`` processes that share load through it and each follow both replicas' events,
when a conversation's turns go to different gateways -- its first turn even straight to a replica,
around every gateway -- then each later turn lands on the replica that holds its prefix: vLLM's
own ``prefix_cache_hits`` grow there and nowhere else. Two conversations start on different
replicas, so at least one of them starts where the gateways' consistent-hash fallback would not
have put it: what places it is the exact index built from the replicas' events, which every gateway
reports (``tidal_router_kv_index_total{source="exact"}``).

And a stream entering through one gateway is counted on its replica by the other two within
:data:`BOUND_S`. A change is published and read every ``shared_state_interval_s`` (50 ms here), so
on an idle machine it is seen after about two intervals plus Redis round trips (about 0.1 s, which
``test_gateway_shared`` holds to 0.5 s in front of simulators). Here a real engine decodes on one of
the two cores, the gateway that streams is busy, and an admin poll takes its own time, so the
test holds the hard bound the design makes -- a count is seen within ``shared_state_ttl_s`` (2 s),
or it is not used at all -- and prints what it measured (0.08-0.95 s on a loaded machine).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.api.harness import DEV_KEY, Gateway, fleet_dict, run_gateway
from tests.services import require_tcp
from tidal.replicas.wire.prom import parse_samples

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

BOUND_S = 2.0  # the fleet's shared_state_ttl_s below
REDIS = "redis://127.0.0.1:6379/0"
# About 900 tokens of the tiny model's tokenizer: several full KV blocks on the CPU backend.
SYSTEM = {
    "a": "You are the help desk of a ferry company; answer about timetables and tickets. " * 45,
    "b": "You are a gardening assistant; answer about soil, pruning and watering plans. " * 45,
}


def _hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for s in parse_samples(text) if s.name == "vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def replicas(vllm_factory: Any) -> list[Any]:
    return vllm_factory.start(2, kv_events=True)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def gateways(
    replicas: list[Any], tiny_model_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Gateway]]:
    require_tcp("Redis", "127.0.0.1", 6379)
    fleet = fleet_dict([p.url for p in replicas], wait_budget_s=30.0)
    fleet["models"][0]["tokenizer"] = str(tiny_model_root / "model")
    for spec, p in zip(fleet["pools"]["interactive"]["replicas"], replicas, strict=True):
        spec["kv_events"] = p.kv_events_spec()
    fleet["gateway"]["shared_state_interval_s"] = 0.05
    fleet["gateway"]["shared_state_ttl_s"] = BOUND_S
    env = {"TIDAL_REDIS_URL": REDIS, "TIDAL_REDIS_NAMESPACE": f"tidal-test-{secrets.token_hex(4)}"}
    tmp = tmp_path_factory.mktemp("gw-fleet")
    with contextlib.ExitStack() as stack:
        gws = [stack.enter_context(run_gateway(tmp, fleet, env=env)) for _ in range(3)]
        deadline = time.monotonic() + 20
        while not all(g.metric("tidal_gateway_shared_state_gateways") == 3 for g in gws):
            assert time.monotonic() < deadline, "the gateways never saw each other through Redis"
            time.sleep(0.1)
        yield gws


def _ask(target: str, messages: list[dict[str, str]], key: str = DEV_KEY) -> str:
    """One chat turn of 8 tokens at ``target`` (a gateway or a replica); the assistant's reply."""
    client = openai.OpenAI(base_url=target + "/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    return reply.choices[0].message.content or ""


def _indexed(gw: Gateway, name: str, blocks: int) -> bool:
    rows = {r["name"]: r for r in gw.admin("GET", "/admin/replicas").json()["data"]}
    kv = rows[name]["kv_events"]
    return kv is not None and kv["blocks"] >= blocks


def test_a_conversation_across_gateways_lands_on_the_replica_holding_its_prefix(
    replicas: list[Any], gateways: list[Gateway]
) -> None:
    urls = [p.url for p in replicas]
    names = ["replica-0", "replica-1"]
    exact = [g.metric("tidal_router_kv_index_total", source="exact") for g in gateways]
    placed: list[tuple[str, int, int]] = []
    for conv, holder in (("a", 0), ("b", 1)):
        # Given a conversation whose first turn went straight to one replica,
        messages = [
            {"role": "system", "content": SYSTEM[conv]},
            {"role": "user", "content": f"Question one of conversation {conv}?"},
        ]
        messages.append({"role": "assistant", "content": _ask(urls[holder], messages, key="unused")})
        # (every gateway has indexed that replica's blocks from its events),
        deadline = time.monotonic() + 10
        while not all(_indexed(g, names[holder], 4) for g in gateways):
            assert time.monotonic() < deadline, "the gateways never indexed the replica's blocks"
            time.sleep(0.05)
        # When its next turns come through each gateway in turn,
        for turn, gw in enumerate(gateways, start=2):
            messages.append({"role": "user", "content": f"Question {turn} of conversation {conv}?"})
            before = [_hits(u) for u in urls]
            messages.append({"role": "assistant", "content": _ask(gw.url, messages)})
            after = [_hits(u) for u in urls]
            gained = [round(b - a) for a, b in zip(before, after, strict=True)]
            placed.append((conv, turn, gained.index(max(gained))))
            # Then the replica that holds the prefix served it from its cache, and no other ran it.
            assert gained[holder] >= 512 and gained[1 - holder] == 0, (conv, turn, gained)
    print(f"\nturns placed (conversation, turn, replica): {placed}")
    # Each gateway placed by its exact index of the replicas' cache.
    for g, n in zip(gateways, exact, strict=True):
        assert g.metric("tidal_router_kv_index_total", source="exact") >= n + 2


def _seen_after(gw: Gateway, t0: threading.Event, since: list[float], timeout: float) -> float | None:
    """Poll ``gw`` until it counts one request in flight; seconds from ``since[0]`` (set when
    ``t0`` is) to the answer that showed it (an upper bound: the answer takes its own time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = gw.admin("GET", "/admin/replicas").json()["data"]
        if sum(r["inflight_all"] for r in rows) == 1 and t0.is_set():
            return max(0.0, time.monotonic() - since[0])
        time.sleep(0.005)
    return None


def test_a_stream_entering_one_gateway_is_counted_by_the_others_within_the_bound(
    gateways: list[Gateway],
) -> None:
    delays: list[float] = []
    for play in range(3):
        first = threading.Event()
        since = [0.0]
        status = [0]  # the stream's, for a failure's message

        def stream(
            play: int = play,
            first: threading.Event = first,
            since: list[float] = since,
            status: list[int] = status,
        ) -> None:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"play {play}: a long story"}],
                "max_tokens": 400,
                "stream": True,
                "ignore_eos": True,
            }
            with gateways[0].sse(body, timeout=120) as resp:
                status[0] = resp.status_code
                for _ in resp.iter_bytes():
                    if not first.is_set():
                        since[0] = time.monotonic()
                        first.set()

        # Given a stream running on a replica through the first gateway (counted there before
        # its first byte reached the client),
        with ThreadPoolExecutor(3) as pool:
            runner = pool.submit(stream)
            # Then each of the other two, polled on its own, counts it there within the bound.
            seen = [pool.submit(_seen_after, g, first, since, 30) for g in gateways[1:]]
            for f in seen:
                d = f.result()
                if d is None:  # (say what became of the stream: refused, ended early, still running)
                    ended = "still running" if not runner.done() else repr(runner.exception() or "ended")
                    raise AssertionError(
                        f"a gateway never counted the other gateway's stream (HTTP {status[0]}, {ended})"
                    )
                delays.append(d)
            runner.result()
    print(f"\nin-flight seen by the other gateways after (s): {[round(d, 3) for d in delays]}")
    assert max(delays) <= BOUND_S
