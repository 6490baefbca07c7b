"""Kubernetes actuator: a pool is a Deployment; scaling sets its ``scale`` subresource.

Uses the official ``kubernetes`` client (the ``k8s`` extra): ``read_namespaced_deployment`` for
what is ready, ``patch_namespaced_deployment_scale`` (a JSON merge patch of ``spec.replicas``)
to scale, ``delete_namespaced_pod`` to replace a broken replica (the ReplicaSet starts a new pod).
The client is synchronous, so calls run in a worker thread.

With a ``registry`` (the gateway admin API), every observation also keeps routing in step with
the pods: each **ready** pod of the Deployment is registered as ``<pod name>`` at
``http://<pod IP>:<port>`` -- with ``kv_events`` ``tcp://<pod IP>:<kv_events.port>`` (and the
replay port) when the target has a ``kv_events`` block, so every gateway follows the pod's
KV-cache events from its registration on; a registered replica named like the Deployment's pods
(``<deployment>-...``) whose pod is gone or not ready is deregistered (the gateway drains it).
Replicas listed in the fleet config are never touched.

Needs RBAC ``get`` on ``deployments``, ``get``/``patch`` on ``deployments/scale`` and
``list``/``delete`` on ``pods`` in the pool's namespace (``deploy/k8s/tidal.yaml``).

Example::

    actuator = KubernetesActuator({"interactive": KubernetesTargetSpec(deployment="vllm", namespace="llm")},
                                  registry=gateway_admin)
    await actuator.scale("interactive", 6)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from tidal.fleet import KubernetesTargetSpec
from tidal.scheduler.autoscaler.actuators import PoolReplicas
from tidal.scheduler.signals import PoolLoad, ReplicaRegistry

__all__ = ["KubernetesActuator", "load_kubernetes_configuration"]

log = logging.getLogger(__name__)


def load_kubernetes_configuration() -> Any:
    """The in-cluster service account if running in a pod, else ``~/.kube/config``."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return client.Configuration.get_default_copy()


def _kv_events(t: KubernetesTargetSpec, host: str) -> dict[str, str | None] | None:
    """Where a pod at ``host`` (an IP, IPv6 in brackets) publishes KV events, if the pool's do."""
    kv = t.kv_events
    if kv is None:
        return None
    return {
        "endpoint": f"tcp://{host}:{kv.port}",
        "replay_endpoint": f"tcp://{host}:{kv.replay_port}" if kv.replay_port is not None else None,
        "topic": kv.topic,
    }


class KubernetesActuator:
    """Scales Deployments (see the module docstring).

    **Parameters:** ``targets`` -- the Deployment of each pool; ``configuration`` -- a
    ``kubernetes.client.Configuration`` (default: :func:`load_kubernetes_configuration`);
    ``registry`` -- if given, ready pods are registered with the gateway and gone ones
    deregistered (see the module docstring); a replaced replica is deregistered first.
    """

    name = "kubernetes"

    def __init__(
        self,
        targets: Mapping[str, KubernetesTargetSpec],
        *,
        configuration: Any = None,
        registry: ReplicaRegistry | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        from kubernetes import client

        self.targets = dict(targets)
        self.registry = registry
        self.timeout_s = timeout_s
        self._api_client = client.ApiClient(configuration or load_kubernetes_configuration())
        self._apps = client.AppsV1Api(self._api_client)
        self._core = client.CoreV1Api(self._api_client)

    def _target(self, pool: str) -> KubernetesTargetSpec:
        try:
            return self.targets[pool]
        except KeyError:
            raise KeyError(f"no Kubernetes deployment configured for pool {pool}") from None

    async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
        t = self._target(pool)
        dep = await asyncio.to_thread(
            self._apps.read_namespaced_deployment, t.deployment, t.namespace, _request_timeout=self.timeout_s
        )
        wanted = int((dep.spec.replicas if dep.spec else 0) or 0)
        ready = int((dep.status.ready_replicas if dep.status else 0) or 0)
        if self.registry is not None:
            labels = dep.spec.selector.match_labels if dep.spec and dep.spec.selector else None
            if labels:
                await self._sync_routing(pool, t, labels)
        return PoolReplicas(ready=ready, starting=max(0, wanted - ready))

    async def _sync_routing(self, pool: str, t: KubernetesTargetSpec, labels: Mapping[str, str]) -> None:
        assert self.registry is not None
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        pods = await asyncio.to_thread(
            self._core.list_namespaced_pod,
            t.namespace,
            label_selector=selector,
            _request_timeout=self.timeout_s,
        )
        serving: dict[str, tuple[str, dict[str, str | None] | None]] = {}
        for pod in pods.items:
            name = pod.metadata.name if pod.metadata else None
            ip = pod.status.pod_ip if pod.status else None
            if not name or not ip or (pod.metadata and pod.metadata.deletion_timestamp):
                continue
            conditions = (pod.status.conditions if pod.status else None) or []
            if any(c.type == "Ready" and c.status == "True" for c in conditions):
                host = f"[{ip}]" if ":" in ip else ip
                serving[name] = (f"http://{host}:{t.port}", _kv_events(t, host))
        registered = {v.name for v in await self.registry.replicas() if v.pool == pool}
        for name, (url, events) in serving.items():
            if name not in registered:
                await self.registry.register(name, url, pool, kv_events=events)
                log.info(
                    "kubernetes: pod %s ready at %s%s, registered in pool %s",
                    name,
                    url,
                    f" (KV events at {events['endpoint']})" if events else "",
                    pool,
                )
        for name in registered:
            if name.startswith(f"{t.deployment}-") and name not in serving:
                await self.registry.deregister(name)
                log.info("kubernetes: pod %s gone or not ready, deregistered", name)

    async def current_scale(self, pool: str) -> int:
        t = self._target(pool)
        scale = await asyncio.to_thread(
            self._apps.read_namespaced_deployment_scale,
            t.deployment,
            t.namespace,
            _request_timeout=self.timeout_s,
        )
        return int((scale.spec.replicas if scale.spec else 0) or 0)

    async def scale(self, pool: str, replicas: int) -> None:
        t = self._target(pool)
        if await self.current_scale(pool) == replicas:
            return
        await asyncio.to_thread(
            self._apps.patch_namespaced_deployment_scale,
            t.deployment,
            t.namespace,
            {"spec": {"replicas": int(replicas)}},
            _content_type="application/merge-patch+json",
            _request_timeout=self.timeout_s,
        )
        log.info("kubernetes: %s/%s scaled to %d", t.namespace, t.deployment, replicas)

    async def replace(self, pool: str, replica: str) -> bool:
        """Take the replica out of routing, then delete its pod; the ReplicaSet makes a new one."""
        from kubernetes.client.exceptions import ApiException

        t = self._target(pool)
        if self.registry is not None:
            try:
                await self.registry.deregister(replica)
            except Exception as exc:
                log.warning("kubernetes: deregistering %s failed: %s", replica, exc)
        try:
            await asyncio.to_thread(
                self._core.delete_namespaced_pod, replica, t.namespace, _request_timeout=self.timeout_s
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        log.info("kubernetes: pod %s/%s deleted for replacement", t.namespace, replica)
        return True

    async def aclose(self) -> None:
        await asyncio.to_thread(self._api_client.close)
