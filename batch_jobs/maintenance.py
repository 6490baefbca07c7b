"""The batch tier's housekeeping, safe to run in several processes at once (every step is a
conditional UPDATE, or a claim under the tenant's row lock): expiry, cancellation, finalisation
nobody finished, unpublished chunks and tenants' windows to top up.

Example::

    sweeper = BatchMaintenance(store, files, clock=ManualClock(start=1.7e9), publisher=publisher,
                               windows=tenant_windows(fleet, settings))
    clock.advance(24 * 3600)
    sweeper.sweep()          # -> {"expired": 1, ...}
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlmodel import Session

from tidal.batch_jobs import queries
from tidal.batch_jobs.dispatch import (
    ChunkPublisher,
    WindowOf,
    release_stale_publishing,
    requeue_stale_running,
    top_up,
)
from tidal.batch_jobs.files import FileStore
from tidal.batch_jobs.finalize import AfterFinal, FinalKind, finalize_batch, release_stale_claims
from tidal.batch_jobs.store import Store
from tidal.clock import Clock

__all__ = ["BatchMaintenance"]

log = logging.getLogger(__name__)


@dataclass
class BatchMaintenance:
    """One sweep = expire overdue batches, finalise cancelled and finished ones, release stale
    finaliser claims, top up every tenant's window with its pending chunks (a safety net: whoever
    finishes a chunk tops up at once) and, for brokers that do not redeliver, republish chunks
    whose worker died. A ``publisher`` needs the tenants' ``windows``."""

    store: Store
    files: FileStore
    clock: Clock
    publisher: ChunkPublisher | None = None
    after_final: AfterFinal | None = None
    republish_stale_running_after_s: float | None = None
    windows: WindowOf | None = None
    extra_steps: list[Callable[[], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.publisher is not None and self.windows is None:
            raise ValueError("a maintenance sweep that publishes needs the tenants' windows")

    def _ids(self, query: Callable[[Session], list[str]]) -> list[str]:
        with self.store.session() as s:
            return query(s)

    def _finalize(self, ids: list[str], kind: FinalKind) -> int:
        n = 0
        for bid in ids:
            try:
                if finalize_batch(
                    self.store, self.files, bid, kind=kind, clock=self.clock, after_final=self.after_final
                ):
                    n += 1
            except Exception:  # one bad batch must not stop the sweep for the others
                log.exception("finalising batch %s (%s) failed", bid, kind)
        return n

    def sweep(self) -> dict[str, int]:
        now = self.clock.now()
        report = {
            "released_claims": release_stale_claims(self.store, now=now),
            "expired": self._finalize(
                self._ids(lambda s: queries.overdue_batch_ids(s, now=int(now))), "expire"
            ),
            "cancelled": self._finalize(self._ids(queries.cancelling_batch_ids), "cancel"),
            "completed": self._finalize(self._ids(queries.finished_batch_ids), "complete"),
        }
        if self.republish_stale_running_after_s is not None:
            report["requeued_stale"] = requeue_stale_running(
                self.store, now=now, stale_after_s=self.republish_stale_running_after_s
            )
        if self.publisher is not None and self.windows is not None:
            report["unclaimed"] = release_stale_publishing(self.store, now=now)
            report["published"] = top_up(self.store, self.publisher, self.windows)
        for step in self.extra_steps:
            try:
                step()
            except Exception:
                log.exception("maintenance step %r failed", step)
        return report
