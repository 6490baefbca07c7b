"""What one gateway process holds: the fleet, settings, keys, metrics and its services."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from tidal.api.auth import KeyStore
from tidal.fleet import FleetConfig
from tidal.settings import Settings

if TYPE_CHECKING:
    from tidal.api.interactive import InteractiveService
    from tidal.api.worker_metrics import WorkerPeers
    from tidal.batch_jobs.jobs import JobService
    from tidal.batch_jobs.service import BatchService

__all__ = ["GatewayState", "LifecycleHook"]

LifecycleHook = Callable[[], Awaitable[None]]


@dataclass
class GatewayState:
    """Shared by every request of one gateway process (``request.app.state.tidal``).

    Services register ``on_startup``/``on_shutdown`` hooks (background scrapers, pools); the app's
    lifespan runs them in order and shuts them down in reverse.
    """

    fleet: FleetConfig
    settings: Settings
    keys: KeyStore
    metrics: CollectorRegistry = field(default_factory=CollectorRegistry)
    on_startup: list[LifecycleHook] = field(default_factory=list)
    on_shutdown: list[LifecycleHook] = field(default_factory=list)
    # The interactive path (api/interactive.py): registry, router, admission, proxy.
    interactive: InteractiveService | None = None
    # The batch tier (api/batch_tier.py): files, batches and jobs.
    batch: BatchService | None = None
    jobs: JobService | None = None
    # This process's place among the workers of ``tidal gateway --workers N`` (api/serve.py).
    workers: WorkerPeers | None = None
