"""The gateway's admin API as the scheduler's :class:`LoadSource` and :class:`ReplicaRegistry`.

The scheduler only ever talks to the gateway URLs it was started with (``--gateway URL``, the
admin key from ``TIDAL_ADMIN_KEY``). With several gateway replicas, reads are merged (waits and
usage: the worst; counts and rates: the sum) and every write goes to each of them, since each
keeps its own registry.

Example::

    async with GatewayAdmin(["http://127.0.0.1:8000"], admin_key=key) as gw:
        report = await gw.load()
        await gw.update("vllm-3", healthy=False)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from tidal.scheduler.signals import GroupLoad, LoadReport, PoolLoad, ReplicaView, SignalError

__all__ = ["GatewayAdmin", "GatewayError", "merge_reports"]

_MAX_BODY = 8 * 1024 * 1024  # an admin answer larger than this is refused, not buffered


class GatewayError(RuntimeError):
    """The gateway's admin API failed or refused a call; ``status`` is the HTTP status if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _One:
    """One gateway's admin API."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, admin_key: str | None) -> None:
        self.base_url = base_url
        self._session = session
        self._headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        ok_statuses: tuple[int, ...] = (),
        timeout: float | None = None,
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        url = self.base_url + path
        # Only a given timeout overrides the session's: aiohttp reads ``timeout=None`` as "no
        # timeout at all", which left every call without one waiting forever on a silent gateway.
        extra: dict[str, Any] = (
            {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout is not None else {}
        )
        try:
            async with self._session.request(method, url, data=data, headers=headers, **extra) as resp:
                raw = await resp.content.read(_MAX_BODY + 1)
                if len(raw) > _MAX_BODY:
                    raise GatewayError(f"{method} {url}: answer larger than {_MAX_BODY} bytes", resp.status)
                if resp.status >= 400 and resp.status not in ok_statuses:
                    raise GatewayError(f"{method} {url}: HTTP {resp.status}: {_message(raw)}", resp.status)
                if not raw or resp.status in ok_statuses:
                    return None
                try:
                    return json.loads(raw)
                except ValueError as exc:
                    raise GatewayError(f"{method} {url}: answer is not JSON", resp.status) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise GatewayError(f"{method} {url}: {exc!r}") from exc


def _message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:300]
    except ValueError:
        pass
    return raw[:300].decode(errors="replace")


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"gateway URL must be http(s)://host[:port], got {url!r}")
    return url.rstrip("/")


def merge_reports(reports: Sequence[LoadReport]) -> LoadReport:
    """One view of several gateways: waits, latencies and KV usage take the worst; counts (queue
    depth, in flight, requests and errors per second) add up, except that gateways sharing load
    state (``scope: fleet``) each count every sharing gateway's already: of those the largest
    count stands for them all (summing would count the fleet once per gateway). The groups'
    counts likewise, by ``groups_scope``."""
    if len(reports) == 1:
        return reports[0]
    fleet = [r for r in reports if r.scope == "fleet"]
    own = [r for r in reports if r.scope != "fleet"]
    pools: dict[str, PoolLoad] = {}
    for name in sorted({p for r in reports for p in r.pools}):
        parts = [r.pools[name] for r in reports if name in r.pools]
        shared = [r.pools[name] for r in fleet if name in r.pools]
        alone = [r.pools[name] for r in own if name in r.pools]

        def count(
            value: Callable[[PoolLoad], float], shared: list[PoolLoad] = shared, alone: list[PoolLoad] = alone
        ) -> float:
            return max(map(value, shared), default=0.0) + sum(map(value, alone))

        rps = count(lambda p: p.requests_per_s)
        errors = count(lambda p: p.error_rate * p.requests_per_s)
        pools[name] = PoolLoad(
            queue_depth=count(lambda p: p.queue_depth),
            queue_wait_p95_s=max(p.queue_wait_p95_s for p in parts),
            ttft_p95_s=max(p.ttft_p95_s for p in parts),
            tpot_p95_s=max(p.tpot_p95_s for p in parts),
            inflight=count(lambda p: p.inflight),
            # Every gateway scrapes the same replicas: the usage is the same fact seen twice.
            kv_cache_usage_max=max(p.kv_cache_usage_max for p in parts),
            kv_cache_usage_mean=max(p.kv_cache_usage_mean for p in parts),
            num_waiting=max(p.num_waiting for p in parts),
            replicas_healthy=min(p.replicas_healthy for p in parts),
            replicas_serving=min(p.replicas_serving for p in parts),
            replicas_total=max(p.replicas_total for p in parts),
            requests_per_s=rps,
            error_rate=min(1.0, errors / rps) if rps > 0 else max(p.error_rate for p in parts),
        )
    groups: dict[str, GroupLoad] = {}
    for name in sorted({g for r in reports for g in r.groups}):
        # (a gateway whose group counts are the fleet's counts every sharing gateway's already)
        shared_g = [r.groups[name] for r in reports if name in r.groups and r.groups_scope == "fleet"]
        alone_g = [r.groups[name] for r in reports if name in r.groups and r.groups_scope != "fleet"]
        req = max((g.requests for g in shared_g), default=0.0) + sum(g.requests for g in alone_g)
        err = max((g.errors for g in shared_g), default=0.0) + sum(g.errors for g in alone_g)
        groups[name] = GroupLoad(requests=req, errors=err, error_rate=err / req if req > 0 else 0.0)
    groups_alone = any(r.groups_scope != "fleet" for r in reports)
    return LoadReport(
        time=max(r.time for r in reports),
        pools=pools,
        groups=groups,
        scope="gateway" if own else "fleet",
        groups_scope="gateway" if groups_alone else "fleet",
    )


class GatewayAdmin:
    """Client of one or more gateways' ``/admin`` API (see the module docstring).

    **Parameters:** ``urls`` -- the gateways (http/https); ``admin_key`` -- sent as a bearer
    token; ``timeout_s`` -- per call, short because the gate polls ``/admin/load`` every 250 ms.
    """

    def __init__(self, urls: Sequence[str], *, admin_key: str | None, timeout_s: float = 2.0) -> None:
        if not urls:
            raise ValueError("at least one gateway URL is needed")
        self.urls = [_check_url(u) for u in urls]
        self._admin_key = admin_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._gateways: list[_One] = []

    def _all(self) -> list[_One]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=32, keepalive_timeout=30)
            )
            self._gateways = [_One(self._session, u, self._admin_key) for u in self.urls]
        return self._gateways

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> GatewayAdmin:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _read_all(self, path: str) -> list[Any]:
        results = await asyncio.gather(*(g.call("GET", path) for g in self._all()), return_exceptions=True)
        good = [r for r in results if not isinstance(r, BaseException)]
        if not good:
            first = next(r for r in results if isinstance(r, BaseException))
            raise GatewayError(f"no gateway answered {path}: {first}") from first
        return good

    async def load(self) -> LoadReport:
        """The merged ``GET /admin/load`` of every gateway that answers."""
        try:
            return merge_reports([LoadReport.from_json(body) for body in await self._read_all("/admin/load")])
        except SignalError as exc:
            raise GatewayError(f"/admin/load: {exc}") from exc

    async def replicas(self) -> list[ReplicaView]:
        """Registered replicas; one that any gateway holds unhealthy or draining is reported so."""
        merged: dict[str, ReplicaView] = {}
        try:
            for body in await self._read_all("/admin/replicas"):
                data = body.get("data") if isinstance(body, dict) else None
                if not isinstance(data, list):
                    raise GatewayError("/admin/replicas: expected {'data': [...]}")
                for item in data:
                    view = ReplicaView.from_json(item)
                    prev = merged.get(view.name)
                    if prev is not None:
                        view = ReplicaView(
                            name=view.name,
                            url=prev.url,
                            pool=prev.pool,
                            group=prev.group,
                            weight=prev.weight,
                            healthy=prev.healthy and view.healthy,
                            draining=prev.draining or view.draining,
                            inflight=prev.inflight + view.inflight,
                        )
                    merged[view.name] = view
        except SignalError as exc:
            raise GatewayError(f"/admin/replicas: {exc}") from exc
        return list(merged.values())

    async def _write_all(
        self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (), timeout: float | None = None
    ) -> None:
        results = await asyncio.gather(
            *(g.call(method, path, body, ok_statuses=ok, timeout=timeout) for g in self._all()),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise GatewayError(
                f"{method} {path} failed on {len(errors)} of {len(results)} gateway(s): {errors[0]}",
                getattr(errors[0], "status", None),
            ) from errors[0]

    async def register(
        self,
        name: str,
        url: str,
        pool: str,
        *,
        group: str = "stable",
        weight: float = 1.0,
        max_loras: int = 0,
        kv_events: Mapping[str, str | None] | None = None,
    ) -> None:
        """``POST /admin/replicas``; a name that already exists (409) counts as registered.
        ``kv_events`` (``endpoint``, ``replay_endpoint``, ``topic``) is where the replica
        publishes its KV-cache events, for the gateways to follow."""
        body: dict[str, Any] = {
            "name": name,
            "url": url,
            "pool": pool,
            "group": group,
            "weight": weight,
            "max_loras": max_loras,
        }
        if kv_events is not None:
            body["kv_events"] = dict(kv_events)
        await self._write_all("POST", "/admin/replicas", body, ok=(409,))

    async def update(
        self,
        name: str,
        *,
        healthy: bool | None = None,
        weight: float | None = None,
        draining: bool | None = None,
    ) -> None:
        """``PATCH /admin/replicas/{name}`` with the fields given."""
        body: dict[str, Any] = {}
        if healthy is not None:
            body["healthy"] = healthy
        if weight is not None:
            body["weight"] = weight
        if draining is not None:
            body["draining"] = draining
        if not body:
            return
        await self._write_all("PATCH", f"/admin/replicas/{quote(name, safe='')}", body)

    async def deregister(self, name: str, *, drain_timeout_s: float = 30.0) -> None:
        """``DELETE /admin/replicas/{name}``: the gateway drains it first, for up to ``drain_timeout_s``.

        Returns when every gateway removed it (200) or will once its last request ends (202);
        an unknown name (404) is fine.
        """
        path = f"/admin/replicas/{quote(name, safe='')}?timeout_s={drain_timeout_s:g}"
        await self._write_all("DELETE", path, ok=(404,), timeout=drain_timeout_s + 5.0)
