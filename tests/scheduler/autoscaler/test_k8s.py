"""The Kubernetes actuator through the official client, against a small API server over real HTTP.

The server speaks the apps/v1 Deployment and ``scale`` subresource (and pod deletion) the way the
Kubernetes API server does -- JSON bodies, merge-patch content type, bearer auth, 404/415 -- so
the real client code (serialisation, auth, content negotiation) runs end to end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.services import require_module
from tidal.fleet import KubernetesTargetSpec
from tidal.scheduler.signals import ReplicaView

pytestmark = pytest.mark.anyio

TOKEN = "k8s-test-token"


class FakeApiServer:
    def __init__(self) -> None:
        self.deployments: dict[tuple[str, str], dict[str, int]] = {("llm", "vllm"): {"spec": 2, "ready": 2}}
        # (namespace, pod name) -> (pod IP, ready)
        self.pods: dict[tuple[str, str], tuple[str, bool]] = {
            ("llm", "vllm-abc"): ("10.0.0.5", True),
            ("llm", "vllm-def"): ("10.0.0.6", True),
        }
        self.selectors: list[str] = []
        self.patches: list[tuple[str, Any]] = []
        app = web.Application(middlewares=[self._auth])
        base = "/apis/apps/v1/namespaces/{ns}/deployments/{name}"
        app.router.add_get(base, self._get_deployment)
        app.router.add_get(base + "/scale", self._get_scale)
        app.router.add_patch(base + "/scale", self._patch_scale)
        app.router.add_delete("/api/v1/namespaces/{ns}/pods/{name}", self._delete_pod)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._list_pods)
        self.server = TestServer(app, host="127.0.0.1")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._status(401, "Unauthorized", "Unauthorized")
        response: web.StreamResponse = await handler(request)
        return response

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }
        return web.json_response(body, status=code)

    def _dep(self, request: web.Request) -> tuple[tuple[str, str], dict[str, int] | None]:
        key = (request.match_info["ns"], request.match_info["name"])
        return key, self.deployments.get(key)

    async def _get_deployment(self, request: web.Request) -> web.Response:
        (ns, name), d = self._dep(request)
        if d is None:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        labels = {"app": name}
        return web.json_response(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "replicas": d["spec"],
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
                    },
                },
                "status": {"replicas": d["spec"], "readyReplicas": d["ready"]},
            }
        )

    def _scale(self, ns: str, name: str, d: dict[str, int]) -> web.Response:
        return web.json_response(
            {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"replicas": d["spec"]},
                "status": {"replicas": d["spec"], "selector": f"app={name}"},
            }
        )

    async def _get_scale(self, request: web.Request) -> web.Response:
        (ns, name), d = self._dep(request)
        if d is None:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        return self._scale(ns, name, d)

    async def _patch_scale(self, request: web.Request) -> web.Response:
        (ns, name), d = self._dep(request)
        if d is None:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        ctype = request.headers.get("Content-Type", "")
        if ctype != "application/merge-patch+json":
            return self._status(
                415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}"
            )
        body = json.loads(await request.read())
        self.patches.append((ctype, body))
        d["spec"] = int(body["spec"]["replicas"])
        return self._scale(ns, name, d)

    async def _list_pods(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        selector = request.query.get("labelSelector", "")
        self.selectors.append(selector)
        items = [
            {
                "metadata": {"name": name, "namespace": ns, "labels": {"app": "vllm"}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
                "status": {
                    "phase": "Running",
                    "podIP": ip,
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                },
            }
            for (pns, name), (ip, ready) in sorted(self.pods.items())
            if pns == ns and selector == "app=vllm"
        ]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

    async def _delete_pod(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.pods:
            return self._status(404, "NotFound", f'pods "{key[1]}" not found')
        del self.pods[key]
        # Like the API server: the deleted pod, now carrying a deletion timestamp.
        return web.json_response(
            {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {
                    "name": key[1],
                    "namespace": key[0],
                    "deletionTimestamp": "2026-01-01T00:00:30Z",
                },
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
                "status": {"phase": "Running"},
            }
        )


@pytest.fixture
async def api_server() -> AsyncIterator[FakeApiServer]:
    require_module("kubernetes", "install the `k8s` extra")
    server = FakeApiServer()
    await server.server.start_server()
    yield server
    await server.server.close()


class Registry:
    def __init__(self) -> None:
        self.views: dict[str, ReplicaView] = {
            "static-0": ReplicaView("static-0", "http://10.9.9.9:8000", "interactive")
        }
        self.kv_events: dict[str, Any] = {}

    async def replicas(self) -> list[ReplicaView]:
        return list(self.views.values())

    async def register(self, name: str, url: str, pool: str, *, kv_events: Any = None, **_: Any) -> None:
        self.views[name] = ReplicaView(name, url, pool)
        self.kv_events[name] = None if kv_events is None else dict(kv_events)

    async def update(self, name: str, **_: Any) -> None:
        pass

    async def deregister(self, name: str) -> None:
        self.views.pop(name, None)


def actuator(
    server: FakeApiServer,
    token: str = TOKEN,
    registry: Registry | None = None,
    interactive: KubernetesTargetSpec | None = None,
) -> Any:
    from kubernetes import client

    from tidal.scheduler.autoscaler.k8s import KubernetesActuator

    config = client.Configuration(host=str(server.server.make_url("")).rstrip("/"))
    config.api_key = {"BearerToken": token}
    config.api_key_prefix = {"BearerToken": "Bearer"}
    return KubernetesActuator(
        {
            "interactive": interactive or KubernetesTargetSpec(deployment="vllm", namespace="llm"),
            "ghost": KubernetesTargetSpec(deployment="none"),
        },
        configuration=config,
        registry=registry,
    )


async def test_scaling_a_deployment_through_the_scale_subresource(api_server: FakeApiServer) -> None:
    act = actuator(api_server)
    try:
        # Given a Deployment with 2 ready replicas
        seen = await act.observe("interactive", None)
        assert (seen.ready, seen.starting) == (2, 0)
        # When the autoscaler asks for 5
        await act.scale("interactive", 5)
        # Then the scale subresource got a merge patch, and 3 are starting until the pods are ready
        assert api_server.patches == [("application/merge-patch+json", {"spec": {"replicas": 5}})]
        seen = await act.observe("interactive", None)
        assert (seen.ready, seen.starting) == (2, 3)
        # And asking for the same size again sends nothing
        await act.scale("interactive", 5)
        assert len(api_server.patches) == 1
        api_server.deployments[("llm", "vllm")]["ready"] = 5
        assert (await act.observe("interactive", None)).ready == 5
    finally:
        await act.aclose()


async def test_ready_pods_are_registered_and_gone_ones_deregistered(api_server: FakeApiServer) -> None:
    registry = Registry()
    act = actuator(api_server, registry=registry)
    try:
        # Given two ready pods; when the actuator observes the pool, both are routed to
        await act.observe("interactive", None)
        assert api_server.selectors == ["app=vllm"]
        assert {n: v.url for n, v in registry.views.items()} == {
            "static-0": "http://10.9.9.9:8000",
            "vllm-abc": "http://10.0.0.5:8000",
            "vllm-def": "http://10.0.0.6:8000",
        }
        # When one pod stops being ready and a new one becomes ready
        api_server.pods[("llm", "vllm-def")] = ("10.0.0.6", False)
        api_server.pods[("llm", "vllm-ghi")] = ("10.0.0.7", True)
        await act.observe("interactive", None)
        # Then routing follows; the replica from the fleet config is left alone
        assert set(registry.views) == {"static-0", "vllm-abc", "vllm-ghi"}
        # When a replica is replaced, it leaves routing and its pod is deleted
        assert await act.replace("interactive", "vllm-abc")
        assert ("llm", "vllm-abc") not in api_server.pods and "vllm-abc" not in registry.views
        assert not await act.replace("interactive", "vllm-abc")
    finally:
        await act.aclose()


async def test_ready_pods_are_registered_with_where_they_publish_kv_events(api_server: FakeApiServer) -> None:
    # Given a pool whose pods publish KV events on 5557 with replay on 5558, one pod on IPv6
    api_server.pods[("llm", "vllm-def")] = ("fd00::6", True)
    target = KubernetesTargetSpec.model_validate(
        {
            "deployment": "vllm",
            "namespace": "llm",
            "kv_events": {"port": 5557, "replay_port": 5558, "topic": "kv"},
        }
    )
    registry = Registry()
    act = actuator(api_server, registry=registry, interactive=target)
    try:
        # When the actuator observes the pool
        await act.observe("interactive", None)
        # Then each ready pod is registered with its URL and its event endpoints on the pod's IP
        assert {n: v.url for n, v in registry.views.items() if n != "static-0"} == {
            "vllm-abc": "http://10.0.0.5:8000",
            "vllm-def": "http://[fd00::6]:8000",
        }
        assert registry.kv_events == {
            "vllm-abc": {
                "endpoint": "tcp://10.0.0.5:5557",
                "replay_endpoint": "tcp://10.0.0.5:5558",
                "topic": "kv",
            },
            "vllm-def": {
                "endpoint": "tcp://[fd00::6]:5557",
                "replay_endpoint": "tcp://[fd00::6]:5558",
                "topic": "kv",
            },
        }
    finally:
        await act.aclose()
    # Without a replay port, none is announced; without a kv_events block, no events at all
    registry = Registry()
    plain = KubernetesTargetSpec.model_validate(
        {"deployment": "vllm", "namespace": "llm", "kv_events": {"port": 6000}}
    )
    act = actuator(api_server, registry=registry, interactive=plain)
    try:
        await act.observe("interactive", None)
        assert registry.kv_events["vllm-abc"] == {
            "endpoint": "tcp://10.0.0.5:6000",
            "replay_endpoint": None,
            "topic": "",
        }
    finally:
        await act.aclose()


async def test_api_errors_surface_as_client_exceptions(api_server: FakeApiServer) -> None:
    from kubernetes.client.exceptions import ApiException

    act = actuator(api_server)
    try:
        with pytest.raises(ApiException) as err:
            await act.scale("ghost", 3)
        assert err.value.status == 404
        with pytest.raises(KeyError):
            await act.scale("unknown-pool", 3)
    finally:
        await act.aclose()
    bad = actuator(api_server, token="wrong")
    try:
        with pytest.raises(ApiException) as err:
            await bad.observe("interactive", None)
        assert err.value.status == 401
    finally:
        await bad.aclose()
