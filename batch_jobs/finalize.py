"""Finalising a batch: exactly one finaliser writes the OpenAI output and error files.

The finaliser is whoever wins a conditional UPDATE on the batch row (``final_claim IS NULL``).
From that moment no result can be written (see :mod:`batch_jobs.results`), so the files hold
every line exactly once:

* ``completed`` -- every line answered; successes in the output file, failures in the error file;
* ``cancelled`` / ``expired`` -- partial results as OpenAI returns them, and each line that never
  ran goes to the error file with code ``batch_cancelled`` / ``batch_expired``.

``request_counts`` then satisfy ``completed + failed == total``.

Example::

    finalize_batch(store, files, "batch_abc", kind="complete", clock=WallClock())
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Iterator

from sqlmodel import col, select

from tidal.batch_jobs import queries
from tidal.batch_jobs.files import FileStore, new_id
from tidal.batch_jobs.models import BatchLine, BatchRecord, FileRecord
from tidal.batch_jobs.queries import FinalKind
from tidal.batch_jobs.results import error_line, output_line
from tidal.batch_jobs.store import Store, line_counts
from tidal.clock import Clock

__all__ = ["FinalKind", "finalize_batch", "release_stale_claims"]

log = logging.getLogger(__name__)

_UNRUN = {
    "cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
}

AfterFinal = Callable[[BatchRecord], None]


def _claim(store: Store, batch_id: str, kind: FinalKind, now: float) -> str | None:
    token = secrets.token_hex(8)
    with store.session() as s:
        won = queries.claim_batch_final(s, batch_id=batch_id, kind=kind, token=token, now=now)
    return token if won else None


def finalize_batch(
    store: Store,
    files: FileStore,
    batch_id: str,
    *,
    kind: FinalKind,
    clock: Clock,
    after_final: AfterFinal | None = None,
) -> BatchRecord | None:
    """Finalise if this caller wins the claim; returns the final batch, or None if it did not."""
    token = _claim(store, batch_id, kind, clock.now())
    if token is None:
        return None
    return _write_final(store, files, batch_id, token, clock, after_final)


def _write_final(
    store: Store, files: FileStore, batch_id: str, token: str, clock: Clock, after_final: AfterFinal | None
) -> BatchRecord | None:
    with store.session() as s:
        batch = s.exec(select(BatchRecord).where(BatchRecord.id == batch_id)).one()
        final_status = batch.final_status or "completed"
        if final_status in _UNRUN:
            code, message = _UNRUN[final_status]
            queries.fail_unrun_lines(s, batch_id, error_json=json.dumps({"code": code, "message": message}))
    counts_usage = _usage(store, batch_id)
    now = int(clock.now())
    output_id: str | None = None
    try:
        output_id = _write_file(store, files, batch, "done", "output", now) if counts_usage[0] else None
        error_id = _write_file(store, files, batch, "failed", "error", now) if counts_usage[1] else None
    except Exception:
        # E.g. the file store is full: leave nothing half-written (a failed write removes its own
        # part; an output file written before the error file failed is removed here) and release
        # the claim now, so the next sweep tries again as soon as there is room.
        if output_id is not None:
            _discard(store, files, output_id)
        _release(store, batch_id, token)
        raise
    with store.session() as s:
        row = s.exec(select(BatchRecord).where(BatchRecord.id == batch_id)).one()
        if row.final_claim != token:
            return None  # our claim was released as stale and someone else finished it
        counts = line_counts(s, batch_id)
        row.status = final_status
        row.output_file_id = output_id
        row.error_file_id = error_id
        row.total, row.completed, row.failed = counts.total, counts.completed, counts.failed
        row.usage_json = json.dumps(counts_usage[2])
        row.finalizing_at = row.finalizing_at or now
        setattr(row, f"{final_status}_at", now)
        s.add(row)
        queries.close_chunks(s, batch_id)
    log.info("batch %s %s: %d completed, %d failed", batch_id, final_status, counts.completed, counts.failed)
    if after_final is not None:
        after_final(row)
    return row


def _usage(store: Store, batch_id: str) -> tuple[int, int, dict[str, object]]:
    with store.session() as s:
        row = queries.line_usage(s, batch_id)
    done, failed, inp, out, cached = (int(v or 0) for v in row)
    usage: dict[str, object] = {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }
    return done, failed, usage


def _lines(store: Store, batch: BatchRecord, state: str) -> Iterator[str]:
    last = 0
    while True:
        with store.session() as s:
            page = s.exec(
                select(BatchLine)
                .where(
                    BatchLine.batch_id == batch.id, BatchLine.state == state, col(BatchLine.line_no) > last
                )
                .order_by(col(BatchLine.line_no))
                .limit(1000)
            ).all()
        if not page:
            return
        for line in page:
            if line.status_code is not None:
                yield output_line(
                    batch.id, line.custom_id, line.status_code, line.request_id, line.response_body or "null"
                )
            else:
                yield error_line(batch.id, line.custom_id, json.loads(line.error_json or "{}"))
        last = page[-1].line_no


def _write_file(store: Store, files: FileStore, batch: BatchRecord, state: str, kind: str, now: int) -> str:
    file_id = new_id("file-")
    rel, size = files.save_lines(batch.tenant, file_id, _lines(store, batch, state))
    with store.session() as s:
        s.add(
            FileRecord(
                id=file_id,
                tenant=batch.tenant,
                purpose="batch_output",
                filename=f"{batch.id}_{kind}.jsonl",
                bytes=size,
                created_at=now,
                path=rel,
            )
        )
    return file_id


def _discard(store: Store, files: FileStore, file_id: str) -> None:
    """Remove a file a failed finalisation wrote (its record and its bytes)."""
    with store.session() as s:
        rec = s.exec(select(FileRecord).where(FileRecord.id == file_id)).one()
        files.delete(rec.path)
        s.delete(rec)


def _release(store: Store, batch_id: str, token: str) -> None:
    """Give up this finaliser's claim (only ours), back to ``in_progress`` where it was finalising."""
    with store.session() as s:
        queries.release_final_claim(s, batch_id, token=token)


def release_stale_claims(store: Store, *, now: float, older_than_s: float = 120.0) -> int:
    """Let another finaliser retry when one died between its claim and the final status."""
    with store.session() as s:
        return queries.release_stale_final_claims(s, cut=now - older_than_s)
