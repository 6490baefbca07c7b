"""Wiring the batch tier into the gateway: the services on the state, the maintenance loop, and
turning the services' refusals into OpenAI-shaped errors.

Example::

    state = GatewayState(fleet=fleet, settings=settings, keys=keys)
    install_batch_tier(state)        # state.batch, state.jobs; start/stop hooks registered
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Iterator

from starlette.concurrency import run_in_threadpool

from tidal.api.errors import APIError
from tidal.api.state import GatewayState
from tidal.batch_jobs.dispatch import CeleryChunkPublisher
from tidal.batch_jobs.errors import BatchTierError
from tidal.batch_jobs.jobs import JobService
from tidal.batch_jobs.maintenance import BatchMaintenance
from tidal.batch_jobs.service import BatchService
from tidal.priority.queues import Topology, declare_topology, is_amqp

__all__ = ["batch_errors", "install_batch_tier"]

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0


@contextlib.contextmanager
def batch_errors() -> Iterator[None]:
    """Answer a service's refusal (404, 400, 413, ...) in OpenAI's error shape."""
    try:
        yield
    except BatchTierError as exc:
        raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise APIError(507, "The file store is full; try again later.", code="insufficient_storage") from None


def install_batch_tier(state: GatewayState) -> None:
    """Register the batch tier's start/stop hooks: at start-up the services are created on the
    state (the store opens, the queues are declared, the maintenance loop starts); an app that
    never starts (no lifespan) answers the batch routes with 503 and touches nothing."""
    settings = state.settings
    task: asyncio.Task[None] | None = None
    publisher: CeleryChunkPublisher | None = None
    stopping = asyncio.Event()

    async def start() -> None:
        nonlocal task, publisher
        stopping.clear()
        publisher = CeleryChunkPublisher.from_settings(settings)
        service = await run_in_threadpool(
            BatchService.from_settings, state.fleet, settings, publisher=publisher
        )
        jobs = JobService(service)
        sweeper = BatchMaintenance(
            service.store,
            service.files,
            clock=service.clock,
            publisher=publisher,
            after_final=jobs.after_final,
            # The embedded broker does not redeliver a dead worker's message: republish its chunk.
            republish_stale_running_after_s=None if is_amqp(settings.broker_url) else 120.0,
            windows=service.windows,
            extra_steps=[jobs.advance_stuck],
        )
        if is_amqp(settings.broker_url):
            try:
                await run_in_threadpool(
                    declare_topology, settings.broker_url, Topology(settings.queue_namespace)
                )
            except Exception as exc:  # the broker may come later; publishing retries in the sweep
                log.warning("could not declare the batch queues yet: %r", exc)
        state.batch, state.jobs = service, jobs

        async def loop() -> None:
            while not stopping.is_set():
                try:
                    await run_in_threadpool(sweeper.sweep)
                except Exception:
                    log.exception("batch maintenance sweep failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), SWEEP_INTERVAL_S)

        task = asyncio.create_task(loop(), name="batch-maintenance")

    async def stop() -> None:
        # Let a sweep in progress finish (its thread holds a database connection) before the
        # store is closed; cancelling would leave the thread running past dispose().
        stopping.set()
        if task is not None:
            await task
        if publisher is not None:
            publisher.close()
        if state.batch is not None:
            state.batch.store.dispose()
        state.batch = state.jobs = None

    state.on_startup.append(start)
    state.on_shutdown.append(stop)
