"""The worker entry point: ``tidal worker --lane LANE``.

Example::

    run_worker(get_settings(), load_fleet("fleet.yaml"), lane="spot", concurrency=4)
"""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

from tidal.batch_jobs.dispatch import CeleryChunkPublisher
from tidal.fleet import FleetConfig
from tidal.priority.queues import Topology, declare_topology, is_amqp
from tidal.settings import Settings
from tidal.workers.app import make_worker_app
from tidal.workers.runtime import WorkerRuntime

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


def run_worker(
    settings: Settings,
    fleet: FleetConfig,
    *,
    lane: str,
    concurrency: int,
    hostname: str | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    loglevel: str = "INFO",
) -> None:
    """Consume the lane's queues until stopped (SIGTERM: save progress, requeue, exit)."""
    if is_amqp(settings.broker_url):
        declare_topology(settings.broker_url, Topology(settings.queue_namespace))
    publisher = CeleryChunkPublisher.from_settings(settings)  # next stages of jobs
    runtime = WorkerRuntime(
        settings=settings,
        fleet=fleet,
        lane=lane,
        concurrency=concurrency,
        hostname=hostname,
        publisher=publisher,
    )
    app = make_worker_app(runtime)
    if metrics_port:
        start_http_server(metrics_port, addr=metrics_host, registry=runtime.metrics.registry)
    runtime.start()
    queues = runtime.queues()
    log.info("worker %s consuming %s", runtime.hostname, ", ".join(queues) or "nothing (lane paused)")
    worker = app.Worker(
        hostname=runtime.hostname,
        queues=queues or None,
        concurrency=concurrency,
        pool="threads",
        loglevel=loglevel,
        send_events=True,
        task_events=True,
        without_gossip=True,
        without_mingle=True,
        quiet=True,
    )
    if not queues:
        app.amqp.queues.select([])  # consume nothing until the gate reopens
        app.amqp.queues._consume_from = {}
    try:
        worker.start()
    finally:
        runtime.close()
        publisher.close()
    if worker.exitcode:
        raise SystemExit(worker.exitcode)
