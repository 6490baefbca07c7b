"""Isolation at the request level through the official SDK: LoRA adapters bound to tenants,
interactive requests kept off batch and spot pools, ``features: ["*"]``, and data residency
(placement and overflow stay inside a feature's regions).

One gateway in front of two simulated replicas, one per region, and an external provider (a third
simulated replica behind its own key) in us-east.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.api.harness import ACME_KEY, AuthProxy, Gateway, run_gateway
from tidal.fleet import hash_api_key
from tidal.replicas.launcher import ReplicaProcess, sim_process

GLOBEX_KEY = "globex-key-for-tests-0123456789"
INITECH_KEY = "initech-key-for-tests-0123456789"
MSG = [{"role": "user", "content": "hi"}]
DEAD = "http://127.0.0.1:9"


@dataclass
class Scene:
    gw: Gateway
    sims: dict[str, ReplicaProcess]  # region -> replica
    provider: AuthProxy

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gw.url + "/v1", api_key=key, max_retries=0)

    def routed(self, replica: str) -> float:
        return self.gw.metric("tidal_router_decisions_total", replica=replica)

    def loaded(self, region: str) -> set[str]:
        """The adapters a replica holds, as its own ``/v1/models`` lists them."""
        cards = httpx.get(self.sims[region].url + "/v1/models", timeout=10).json()["data"]
        return {c["id"] for c in cards if c.get("parent")}


def _fleet(us: str, eu: str, provider: str) -> dict[str, Any]:
    def pool(region: str, url: str, **kw: Any) -> dict[str, Any]:
        return {
            "kind": "interactive",
            "model": "tiny",
            "region": region,
            "max_inflight_per_replica": 4,
            "min_inflight_per_replica": 1,
            "replicas": [{"name": f"{region}-0", "url": url, "max_loras": 2}],
            **kw,
        }

    return {
        "models": [{"name": "tiny", "max_model_len": 4096}, {"name": "bulk"}],
        "adapters": [
            {"name": "acme-lora", "path": "/adapters/acme", "base_model": "tiny", "tenants": ["acme"]},
            {"name": "open-lora", "path": "/adapters/open", "base_model": "tiny"},
        ],
        "pools": {
            "us": pool("us-east", us),
            "eu": pool("eu-west", eu),
            "bulk": {
                "kind": "batch",
                "model": "bulk",
                "region": "eu-west",
                "replicas": [{"name": "b0", "url": DEAD}],
            },
            "bulk-spot": {"kind": "spot", "model": "bulk", "replicas": [{"name": "s0", "url": DEAD}]},
        },
        "features": {
            "default": {"context_cap": 3000},
            "chat": {"context_cap": 3000, "pool": "us"},
            "gdpr": {"context_cap": 3000, "regions": ["eu-west"]},
            "atlantic": {"context_cap": 3000, "regions": ["eu-west", "us-east"]},
        },
        "tenants": [
            {
                "name": "acme",
                "key_hashes": [hash_api_key(ACME_KEY)],
                "features": ["default", "chat", "gdpr", "atlantic"],
            },
            {"name": "globex", "key_hashes": [hash_api_key(GLOBEX_KEY)], "features": ["*"]},
            {"name": "initech", "key_hashes": [hash_api_key(INITECH_KEY)], "features": ["chat"]},
        ],
        "external_provider": {"url": provider, "api_key_env": "TIDAL_TEST_PROVIDER_KEY", "region": "us-east"},
        # No queue: a request that finds no free slot overflows or is refused at once.
        "gateway": {"max_queue": 0, "scrape_interval_s": 0.5},
    }


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    logs = tmp_path_factory.mktemp("isolation")
    args = ["--served-model-name", "tiny", "--max-loras", "2"]
    sims = {
        r: sim_process("fast-test", name=r, args=args, log_path=logs / f"{r}.log")
        for r in ("us", "eu", "ext")
    }
    try:
        for p in sims.values():
            p.start()
        for p in sims.values():
            p.wait_ready(60)
        with AuthProxy(upstream=sims["ext"].url, key="ext-secret") as provider:
            fleet = _fleet(sims["us"].url, sims["eu"].url, provider.url)
            env = {"TIDAL_TEST_PROVIDER_KEY": "ext-secret"}
            with run_gateway(logs, fleet, env=env) as gw:
                yield Scene(gw, sims, provider)
    finally:
        for p in sims.values():
            p.stop()


# -- LoRA adapters bound to tenants ---------------------------------------------------------------


def _not_found(fn: Any) -> dict[str, Any]:
    with pytest.raises(openai.NotFoundError) as err:
        fn()
    body = err.value.response.json()
    assert err.value.code == "model_not_found" and err.value.param == "model", body
    return body  # type: ignore[no-any-return]


def test_an_adapter_bound_to_another_tenant_is_an_unknown_model_and_is_never_loaded(scene: Scene) -> None:
    globex, acme = scene.client(GLOBEX_KEY), scene.client(ACME_KEY)
    # Given an adapter bound to acme, not yet on any replica
    assert "acme-lora" not in scene.loaded("us") | scene.loaded("eu")
    # When globex asks for it as a model, for chat, completions and embeddings,
    bound = _not_found(lambda: globex.chat.completions.create(model="acme-lora", messages=MSG, max_tokens=2))  # type: ignore[arg-type]
    unknown = _not_found(
        lambda: globex.chat.completions.create(model="acme-lorb", messages=MSG, max_tokens=2)
    )  # type: ignore[arg-type]
    _not_found(lambda: globex.completions.create(model="acme-lora", prompt="hi", max_tokens=2))
    _not_found(lambda: globex.embeddings.create(model="acme-lora", input="hi"))
    # Then it gets exactly the 404 of a model that does not exist (only the name differs),
    assert json.dumps(bound) == json.dumps(unknown).replace("acme-lorb", "acme-lora")
    # it is not in its /v1/models, and no replica loaded it on its account
    assert "acme-lora" not in {m.id for m in globex.models.list()}
    assert "open-lora" in {m.id for m in globex.models.list()}
    listed = _not_found(lambda: globex.models.retrieve("acme-lora"))
    assert json.dumps(listed) == json.dumps(_not_found(lambda: globex.models.retrieve("acme-lorb"))).replace(
        "acme-lorb", "acme-lora"
    )
    assert "acme-lora" not in scene.loaded("us") | scene.loaded("eu")
    assert scene.gw.metric("tidal_router_adapter_loads_total") == 0
    # While acme lists it and is served by it (loaded on its first use)
    assert "acme-lora" in {m.id for m in acme.models.list()}
    reply = acme.chat.completions.create(model="acme-lora", messages=MSG, max_tokens=2)
    assert reply.choices
    assert "acme-lora" in scene.loaded("us") | scene.loaded("eu")


# -- interactive requests never on batch or spot pools -------------------------------------------


def test_interactive_requests_are_never_placed_on_batch_or_spot_pools(scene: Scene) -> None:
    # Given a model that only a batch pool and a spot pool serve, an interactive request for it
    # is refused before any replica is tried (those replicas do not even listen)
    with pytest.raises(openai.BadRequestError) as err:
        scene.client(GLOBEX_KEY).chat.completions.create(model="bulk", messages=MSG, max_tokens=2)  # type: ignore[arg-type]
    assert err.value.code == "model_not_available" and err.value.param == "model"
    assert scene.routed("b0") == 0 and scene.routed("s0") == 0


# -- features: ["*"] ------------------------------------------------------------------------------


def test_a_tenant_with_every_feature_may_use_any_feature(scene: Scene) -> None:
    globex, initech = scene.client(GLOBEX_KEY), scene.client(INITECH_KEY)
    # Given globex's features: ["*"], each feature of the fleet is served for its key
    for feature in ("default", "chat", "gdpr", "atlantic"):
        reply = globex.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=2, extra_headers={"X-Tidal-Feature": feature}
        )
        assert reply.choices, feature
    # while a key of a tenant with only chat may not use another one
    with pytest.raises(openai.PermissionDeniedError) as err:
        initech.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=2, extra_headers={"X-Tidal-Feature": "gdpr"}
        )
    assert err.value.code == "feature_not_allowed"


# -- data residency ---------------------------------------------------------------------------


def test_a_features_requests_are_placed_only_in_its_regions(scene: Scene) -> None:
    client = scene.client(ACME_KEY)
    us, eu = scene.routed("us-east-0"), scene.routed("eu-west-0")
    # When gdpr (kept to eu-west) and chat (its pool is in us-east) send requests
    for _ in range(5):
        client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=2, extra_headers={"X-Tidal-Feature": "gdpr"}
        )
    for _ in range(3):
        client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=2, extra_headers={"X-Tidal-Feature": "chat"}
        )
    # Then every gdpr request ran in eu-west, and chat's in us-east
    assert scene.routed("eu-west-0") - eu == 5
    assert scene.routed("us-east-0") - us == 3


def test_overflow_never_leaves_the_features_regions(scene: Scene) -> None:
    client = scene.client(ACME_KEY)
    # Given the eu-west pool without a free slot (its only replica marked unhealthy) and no queue
    r = scene.gw.admin("PATCH", "/admin/replicas/eu-west-0", json={"healthy": False})
    assert r.status_code == 200, r.text
    try:
        before = scene.provider.requests
        # When a gdpr request comes, whose regions do not include the provider's (us-east),
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=2, extra_headers={"X-Tidal-Feature": "gdpr"}
            )
        # Then it is refused with Retry-After rather than overflowed
        assert err.value.code == "pool_saturated" and err.value.response.headers["retry-after"].isdigit()
        assert scene.provider.requests == before
        # while a feature whose regions include us-east overflows to the provider and is answered
        reply = client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=2, extra_headers={"X-Tidal-Feature": "atlantic"}
        )
        assert reply.choices and scene.provider.requests == before + 1
        assert scene.gw.metric("tidal_admission_outcomes_total", feature="gdpr", outcome="rejected_429") == 1
        assert (
            scene.gw.metric("tidal_admission_outcomes_total", feature="atlantic", outcome="overflowed") == 1
        )
    finally:
        scene.gw.admin("PATCH", "/admin/replicas/eu-west-0", json={"healthy": True})


def test_a_replica_registered_at_run_time_is_in_its_pools_region(scene: Scene) -> None:
    # Given a replica registered with the eu-west pool at run time, its first replica unhealthy
    r = scene.gw.admin(
        "POST", "/admin/replicas", json={"name": "eu-west-1", "url": scene.sims["eu"].url, "pool": "eu"}
    )
    assert r.status_code == 201, r.text
    scene.gw.admin("PATCH", "/admin/replicas/eu-west-0", json={"healthy": False})
    try:
        # When gdpr requests come, the new replica serves them: it is in eu-west like its pool
        client = scene.client(ACME_KEY)
        for _ in range(3):
            client.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=2, extra_headers={"X-Tidal-Feature": "gdpr"}
            )
        assert scene.routed("eu-west-1") == 3
    finally:
        scene.gw.admin("PATCH", "/admin/replicas/eu-west-0", json={"healthy": True})
        scene.gw.admin("DELETE", "/admin/replicas/eu-west-1")
