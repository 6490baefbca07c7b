"""``GET /metrics`` of a ``tidal gateway --workers N``: every worker's series, whichever answers.

The workers share one port, so a scrape reaches whichever accepts its connection, and each
keeps its own counters and histograms. Here the worker that answers asks each of the others for
its own series (``GET /metrics?scope=process``) over a Unix socket the supervisor gave each one,
in a private directory, and answers with all of them, each series labelled with the worker it
came from (``worker="0"`` ...). A label rather than a sum: a worker that restarts starts its
counters at zero, which Prometheus reads as a reset of that worker's series instead of a drop in
the gateway's; ``sum without (worker)`` gives the host's figures. A worker that does not answer
within ``timeout_s`` (restarting, or too busy) is left out of that scrape, and
``tidal_gateway_worker_scrape_up{worker}`` says which ones were in it.

The text is parsed and written again with ``prometheus_client`` (its text parser and
``generate_latest``), so every family keeps its type and help and appears once.

Example::

    peers = WorkerPeers(index=0, count=2, socket_dir=Path("/tmp/tidal-gateway-x"))
    body = await peers.merged(generate_latest(registry))
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["WorkerPeers"]

_MAX_BYTES = 64 << 20  # one worker's exposition; far above what a gateway writes


@dataclass(frozen=True)
class WorkerPeers:
    """Worker ``index`` of ``count``; worker ``i`` serves its own series on ``socket_path(i)``."""

    index: int
    count: int
    socket_dir: Path
    timeout_s: float = 2.0

    def socket_path(self, i: int) -> Path:
        return self.socket_dir / f"worker-{i}.sock"

    async def merged(self, own: bytes) -> bytes:
        """The exposition of every worker that answers, ``own`` being this one's."""
        others = [i for i in range(self.count) if i != self.index]
        got = await asyncio.gather(*(self._fetch(i) for i in others))
        texts = {self.index: own, **dict(zip(others, got, strict=True))}
        # (parsed and written in a thread: a large exposition takes a while in Python, and the
        # loop keeps serving meanwhile)
        return await asyncio.to_thread(_merge, texts)

    async def _fetch(self, i: int) -> bytes | None:
        """Worker ``i``'s own series, or ``None`` when it does not answer in time."""
        connector = aiohttp.UnixConnector(path=str(self.socket_path(i)))
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with (
                aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
                session.get("http://worker/metrics", params={"scope": "process"}) as resp,
            ):
                if resp.status == 200:
                    body = await resp.content.read(_MAX_BYTES + 1)
                    if len(body) <= _MAX_BYTES:
                        return body
        return None


def _merge(texts: dict[int, bytes | None]) -> bytes:
    """One exposition of the workers' texts (``None``: did not answer), labelled by worker."""
    families: dict[str, Metric] = {}
    up = GaugeMetricFamily(
        "tidal_gateway_worker_scrape_up",
        "1 for a worker of this gateway whose series are in this scrape, 0 for one that did not answer",
        labels=["worker"],
    )
    for i in sorted(texts):
        parsed = _parse(texts[i])
        up.add_metric([str(i)], 0.0 if parsed is None else 1.0)
        for family in parsed or ():
            merged = families.setdefault(family.name, family)
            labelled = _labelled(family.samples, str(i))
            if merged is family:
                family.samples = labelled
            else:
                merged.samples.extend(labelled)
    families[up.name] = up
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def _parse(text: bytes | None) -> list[Metric] | None:
    if text is None:
        return None
    try:
        return list(text_string_to_metric_families(text.decode()))
    except (ValueError, UnicodeDecodeError):
        return None


def _labelled(samples: Iterable[Sample], worker: str) -> list[Sample]:
    return [Sample(s.name, {**s.labels, "worker": worker}, s.value, s.timestamp, s.exemplar) for s in samples]


@dataclass(frozen=True, eq=False)
class _Families:
    """A collector of families already built (what ``generate_latest`` writes)."""

    families: list[Metric]

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
