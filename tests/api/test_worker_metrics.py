"""``/metrics`` of a ``--workers N`` gateway merges the workers' series (api/worker_metrics.py):
each family once, every sample labelled with its worker, and a worker that does not answer, or
answers with what is not an exposition, is left out and marked so. The other workers are real
HTTP servers on Unix sockets; the whole gateway under ``--workers 2`` is in
``tests/api/test_gateway_shared.py``."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tidal.api.worker_metrics import WorkerPeers


def _exposition(requests: int) -> bytes:
    registry = CollectorRegistry()
    Counter("tidal_things", "Things", ["kind"], registry=registry).labels("a").inc(requests)
    Histogram("tidal_wait_seconds", "Waits", buckets=(0.1, 1.0), registry=registry).observe(0.5)
    return generate_latest(registry)


STUCK = b"(answers after the scrape gave up)"


async def _merged(answers: dict[int, bytes | None], index: int = 0) -> str:
    """Worker ``index``'s merged exposition, the others answering ``answers[i]`` on their
    sockets (``None``: no socket there; ``STUCK``: too late)."""
    with tempfile.TemporaryDirectory() as tmp:
        peers = WorkerPeers(index, len(answers), Path(tmp), timeout_s=0.5)
        runners = []
        for i, body in answers.items():
            if i == index or body is None:
                continue

            async def metrics(request: web.Request, body: bytes = body) -> web.Response:
                assert request.query.get("scope") == "process"
                if body == STUCK:
                    await asyncio.sleep(1.5)
                return web.Response(body=body, content_type="text/plain")

            app = web.Application()
            app.router.add_get("/metrics", metrics)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.UnixSite(runner, str(peers.socket_path(i))).start()
            runners.append(runner)
        try:
            own = answers[index]
            assert own is not None
            return (await peers.merged(own)).decode()
        finally:
            for runner in runners:
                await runner.cleanup()


def test_every_workers_series_are_labelled_and_each_family_appears_once() -> None:
    text = asyncio.run(_merged({0: _exposition(3), 1: _exposition(5), 2: _exposition(7)}, index=1))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    things = {
        s.labels["worker"]: s.value
        for s in families["tidal_things"].samples
        if s.name == "tidal_things_total"
    }
    assert things == {"0": 3.0, "1": 5.0, "2": 7.0}
    counts = [s for s in families["tidal_wait_seconds"].samples if s.name == "tidal_wait_seconds_count"]
    assert sorted(s.labels["worker"] for s in counts) == ["0", "1", "2"]
    assert text.count("# TYPE tidal_wait_seconds histogram") == 1
    up = {s.labels["worker"]: s.value for s in families["tidal_gateway_worker_scrape_up"].samples}
    assert up == {"0": 1.0, "1": 1.0, "2": 1.0}


def test_a_worker_that_does_not_answer_or_answers_nonsense_is_left_out_and_marked() -> None:
    text = asyncio.run(_merged({0: _exposition(3), 1: None, 2: b"not {an exposition", 3: STUCK}))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    things = {
        s.labels["worker"]: s.value
        for s in families["tidal_things"].samples
        if s.name == "tidal_things_total"
    }
    assert things == {"0": 3.0}
    up = {s.labels["worker"]: s.value for s in families["tidal_gateway_worker_scrape_up"].samples}
    assert up == {"0": 1.0, "1": 0.0, "2": 0.0, "3": 0.0}
