"""Wiring the batch tier into the gateway: the services on the state, the maintenance loop, and
turning the services' refusals into OpenAI-shaped errors.

Example::

    state = GatewayState(fleet=fleet, settings=settings, keys=keys)
    install_batch_tier(state)        # state.batch, state.jobs; start/stop hooks registered
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from starlette.concurrency import run_in_threadpool

from api.errors import APIError
from api.state import GatewayState
from batch_jobs.dispatch import CeleryChunkPublisher
from batch_jobs.errors import BatchTierError
from batch_jobs.jobs import JobService
from batch_jobs.maintenance import BatchMaintenance
from batch_jobs.service import BatchService
from priority.queues import Topology, declare_topology, is_amqp

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


def install_batch_tier(state: GatewayState) -> None:
    """Create the batch services for this gateway and register their start/stop hooks."""
    settings = state.settings
    publisher = CeleryChunkPublisher.from_settings(settings)
    service = BatchService.from_settings(state.fleet, settings, publisher=publisher)
    jobs = JobService(service)
    state.batch = service
    state.jobs = jobs
    sweeper = BatchMaintenance(
        service.store,
        service.files,
        clock=service.clock,
        publisher=publisher,
        after_final=jobs.after_final,
        # The embedded broker does not redeliver a dead worker's message: republish its chunk.
        republish_stale_running_after_s=None if is_amqp(settings.broker_url) else 120.0,
        extra_steps=[jobs.advance_stuck],
    )
    task: asyncio.Task[None] | None = None

    async def loop() -> None:
        while True:
            try:
                await run_in_threadpool(sweeper.sweep)
            except Exception:
                log.exception("batch maintenance sweep failed")
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def start() -> None:
        nonlocal task
        if is_amqp(settings.broker_url):
            try:
                await run_in_threadpool(
                    declare_topology, settings.broker_url, Topology(settings.queue_namespace)
                )
            except Exception as exc:  # the broker may come later; publishing retries in the sweep
                log.warning("could not declare the batch queues yet: %r", exc)
        task = asyncio.create_task(loop(), name="batch-maintenance")

    async def stop() -> None:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        publisher.close()
        service.store.dispose()

    state.on_startup.append(start)
    state.on_shutdown.append(stop)
