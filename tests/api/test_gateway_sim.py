"""The gateway in front of simulated replicas (``tidal sim``), as ``tidal up`` runs it: chat on a
generative pool, embeddings on an embedding pool, the admin key shared with the scheduler."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.api.harness import DEV_KEY, Gateway, run_gateway
from tidal.cli.up import plan_parts
from tidal.defaults import DEFAULT_FLEET_PATH
from tidal.replicas.launcher import ReplicaProcess, sim_process


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ReplicaProcess]]:
    logs = tmp_path_factory.mktemp("sims")
    procs = [
        sim_process("fast-test", args=["--served-model-name", "chat-model"], log_path=logs / "chat.log"),
        sim_process(
            "e5-mistral-7b-h100", args=["--served-model-name", "embed-model"], log_path=logs / "e5.log"
        ),
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


@pytest.fixture(scope="module")
def gateway(sims: list[ReplicaProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    fleet = {
        "models": [{"name": "chat-model"}, {"name": "embed-model", "embedding": True}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": "chat-model",
                "replicas": [{"name": "c0", "url": sims[0].url}],
            },
            "embeddings": {
                "kind": "interactive",
                "model": "embed-model",
                "replicas": [{"name": "e0", "url": sims[1].url}],
            },
        },
    }
    with run_gateway(tmp_path_factory.mktemp("gw-sim"), fleet) as gw:
        yield gw


def test_chat_and_embeddings_through_the_sdk(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=DEV_KEY, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="chat-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
    )
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 8
    emb = client.embeddings.create(model="embed-model", input=["one", "two"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0
    assert emb.data[0].embedding != emb.data[1].embedding
    # A model of the other kind is refused by the gateway, OpenAI-shaped, before any replica
    with pytest.raises(openai.BadRequestError) as chat_on_embed:
        client.chat.completions.create(model="embed-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as embed_on_chat:
        client.embeddings.create(model="chat-model", input=["one"])
    for err, needle in (
        (chat_on_embed, "it is an embedding model"),
        (embed_on_chat, "not an embedding model"),
    ):
        assert err.value.code == "model_not_supported" and err.value.param == "model"
        assert needle in err.value.message


def test_a_conversation_is_placed_where_the_gateway_knows_its_history_is_cached(gateway: Gateway) -> None:
    # Given the default profile, whose prefill cost reads the gateway's KV index of each replica,
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=DEV_KEY, max_retries=0)
    before = gateway.metric("tidal_router_prefill_cost_total", result="cached")
    messages = [{"role": "system", "content": "You are a careful assistant. " * 40}]
    # When three turns of one conversation go through the gateway,
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}?"})
        reply = client.chat.completions.create(model="chat-model", messages=messages, max_tokens=4)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or "ok"})
    # Then the second and third were placed on a replica the index says holds their history.
    assert gateway.metric("tidal_router_prefill_cost_total", result="cached") - before == 2


def test_tidal_up_gives_gateway_and_scheduler_one_admin_key(tmp_path: Path) -> None:
    parts = {p.name: p for p in plan_parts(DEFAULT_FLEET_PATH, port=8123, api_key="k", data_dir=tmp_path)}
    gw, sched = parts["gateway"], parts["scheduler"]
    assert gw.env["TIDAL_ADMIN_KEY"] == sched.env["TIDAL_ADMIN_KEY"] and len(gw.env["TIDAL_ADMIN_KEY"]) > 16
    assert "--gateway" in sched.args and "http://127.0.0.1:8123" in sched.args
    assert "TIDAL_ADMIN_KEY" not in parts["worker"].env
