"""The gateway follows replicas' KV events: cache state it did not cause decides where a request goes.

Given ``tidal gateway`` in front of simulated replicas that publish KV events (``tidal sim
--kv-events-config``, the simulator's own tokenizer named by the fleet's ``models[].tokenizer:
sim``), when a long prompt is cached on one replica by a client that bypassed the gateway, then the
gateway's exact index sees it and sends the same prompt there; a replica registered at run time
announces its events endpoint in the admin API body and is followed the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.api.harness import DEV_KEY, Gateway, run_gateway
from tidal.replicas.launcher import ReplicaProcess, sim_process
from tidal.replicas.wire.prom import parse_samples

SYSTEM = "You are the support assistant of a bicycle shop. " * 60


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ReplicaProcess]]:
    logs = tmp_path_factory.mktemp("kv-sims")
    procs = [
        sim_process(
            "fast-test", args=["--served-model-name", "m"], log_path=logs / f"s{i}.log", kv_events=True
        )
        for i in range(3)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(60)
        yield procs
    finally:
        for p in procs:
            p.stop()


def kv_spec(p: ReplicaProcess) -> dict[str, Any]:
    spec = p.kv_events_spec()
    assert spec is not None
    return spec


@pytest.fixture(scope="module")
def gateway(sims: list[ReplicaProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    fleet = {
        "models": [{"name": "m", "max_model_len": 32768, "tokenizer": "sim"}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": "m",
                "replicas": [
                    {"name": f"s{i}", "url": sims[i].url, "kv_events": kv_spec(sims[i])} for i in range(2)
                ],
            }
        },
        "features": {"default": {"class": "interactive", "context_cap": 32768}},
        "gateway": {"scrape_interval_s": 0.5},
    }
    with run_gateway(tmp_path_factory.mktemp("gw-kv"), fleet) as gw:
        yield gw


def counter(url: str, name: str) -> float:
    return sum(s.value for s in parse_samples(httpx.get(url + "/metrics").text) if s.name == name)


def warm_directly(url: str, messages: list[dict[str, str]]) -> None:
    """A client that bypasses the gateway caches the prompt on one replica."""
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


def wait_for_blocks(gw: Gateway, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        rows = {r["name"]: r for r in gw.admin("GET", "/admin/replicas").json()["data"]}
        kv = rows[name]["kv_events"]
        if kv is not None and kv["blocks"] > 0 and kv["age_s"] is not None and kv["age_s"] < 1.0:
            return dict(kv)
        assert time.monotonic() < deadline, f"no blocks indexed for {name}: {rows[name]}"
        time.sleep(0.05)


def ask(gw: Gateway, messages: list[dict[str, str]]) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=DEV_KEY, max_retries=0)
    client.chat.completions.create(model="m", messages=messages, max_tokens=2)  # type: ignore[arg-type]


def test_cache_state_the_gateway_did_not_cause_decides_placement(
    gateway: Gateway, sims: list[ReplicaProcess]
) -> None:
    # Given a long prompt cached on s1 by a client that went around the gateway,
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Do you fix tubeless tyres?"},
    ]
    warm_directly(sims[1].url, messages)
    kv = wait_for_blocks(gateway, "s1")
    assert kv["complete"] and kv["block_size"] == 16 and kv["gaps"] == 0
    hits = [counter(s.url, "vllm:prefix_cache_hits_total") for s in sims[:2]]
    exact = gateway.metric("tidal_router_kv_index_total", source="exact")
    # When the same conversation comes through the gateway,
    ask(gateway, messages)
    # Then it went to s1, where the engine found the prompt cached, decided on exact state.
    after = [counter(s.url, "vllm:prefix_cache_hits_total") for s in sims[:2]]
    assert after[1] - hits[1] >= 512 and after[0] == hits[0]
    assert gateway.metric("tidal_router_kv_index_total", source="exact") == exact + 1
    assert gateway.metric("tidal_router_kv_events_blocks", replica="s1") > 0


def test_a_replica_registered_at_run_time_announces_its_events(
    gateway: Gateway, sims: list[ReplicaProcess]
) -> None:
    body = {"name": "s2", "url": sims[2].url, "pool": "interactive", "kv_events": kv_spec(sims[2])}
    bad = gateway.admin(
        "POST", "/admin/replicas", json={**body, "name": "s9", "kv_events": {"endpoint": "tcp://*:1"}}
    )
    assert bad.status_code == 400 and "kv_events" in bad.text  # a wildcard address binds, never connects
    r = gateway.admin("POST", "/admin/replicas", json=body)
    assert r.status_code == 201, r.text
    # A prompt no other replica holds any of (s1 has the bicycle shop's system prompt).
    messages = [{"role": "system", "content": "You plan train journeys across Europe. " * 60}]
    warm_directly(sims[2].url, messages)
    wait_for_blocks(gateway, "s2")
    before = counter(sims[2].url, "vllm:prefix_cache_hits_total")
    ask(gateway, messages)
    assert counter(sims[2].url, "vllm:prefix_cache_hits_total") - before >= 512
    assert gateway.admin("DELETE", "/admin/replicas/s2").status_code == 200
