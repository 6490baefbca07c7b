"""The Celery app of the batch workers and its settings.

Every setting here answers a failure mode (see the design notes on the batch tier):

* ``task_acks_late`` + ``worker_prefetch_multiplier=1`` -- a worker holds exactly the chunks it
  runs, so a crash redelivers them and a priority-9 chunk never waits behind prefetched ones;
* ``task_reject_on_worker_lost`` -- a lost worker's chunk is requeued, not acknowledged;
* ``worker_cancel_long_running_tasks_on_connection_loss`` -- no chunk keeps running after its
  message was redelivered elsewhere;
* ``worker_soft_shutdown_timeout`` -- the spot notice window (``TIDAL_SOFT_SHUTDOWN_S``);
* publisher confirms (``confirm_publish``) -- a chunk is queued only once the broker has it;
* the ``threads`` pool -- chunks are I/O (HTTP to replicas); the main thread keeps answering
  remote control (pause) while chunks run.

Example::

    runtime = WorkerRuntime(settings=settings, fleet=fleet, lane="reserved", concurrency=4)
    app = make_worker_app(runtime)
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals

from tidal.batch_jobs.dispatch import producer_app
from tidal.priority.queues import CHUNK_TASK, Topology, celery_base_config
from tidal.settings import Settings
from tidal.workers.runtime import WorkerRuntime

__all__ = ["control_app", "make_worker_app", "worker_settings"]


def worker_settings(settings: Settings, concurrency: int) -> dict[str, Any]:
    return {
        "task_acks_late": True,
        "worker_prefetch_multiplier": 1,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": False,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_soft_shutdown_timeout": settings.soft_shutdown_s,
        "worker_enable_soft_shutdown_on_idle": True,
        "worker_pool": "threads",
        "worker_concurrency": concurrency,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "broker_connection_retry": True,
        "broker_connection_max_retries": None,
        "worker_disable_rate_limits": True,
    }


def make_worker_app(runtime: WorkerRuntime) -> Celery:
    """The consuming app, with the chunk task bound to ``runtime``."""
    settings = runtime.settings
    app = Celery("tidal-worker", set_as_current=False)
    broker_dir = str(settings.resolved_broker_dir.resolve())
    app.conf.update(
        celery_base_config(settings.broker_url, Topology(settings.queue_namespace), broker_dir=broker_dir)
    )
    app.conf.update(worker_settings(settings, runtime.concurrency))

    @app.task(name=CHUNK_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def run_chunk(batch_id: str, chunk_no: int) -> str:
        return runtime.run_chunk(str(batch_id), int(chunk_no))

    def _ready(sender: Any = None, **_: Any) -> None:
        runtime.on_ready(sender)

    def _shutting_down(**_: Any) -> None:
        runtime.on_shutdown()

    signals.worker_ready.connect(_ready, weak=False)
    signals.worker_shutting_down.connect(_shutting_down, weak=False)
    return app


def control_app(settings: Settings) -> Celery:
    """An app for remote control and monitoring (pause/resume, Flower): the shared settings,
    without AMQP heartbeats: nothing beats for this app's pooled connections between two rare
    commands, so with them the broker would close every connection left idle for a few beats."""
    app = producer_app(settings, name="tidal-control")
    app.conf.broker_heartbeat = 0
    return app
