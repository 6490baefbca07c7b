"""The batch tier's hand-written SQL, one small function per statement. No other module (but
``store.py``, ``models.py`` and the migrations) writes SQL that names the store's tables or
columns, so that a schema migration changes these and no caller (queries built from the models,
such as ``select(BatchRecord)``, follow the models by themselves).

The caller owns the session and its transaction (``Store.session()`` commits on success and rolls
back on error); nothing here commits. Most writes are conditional UPDATEs that act as claims:
only the caller whose ``WHERE`` still matches changes the row, so several gateways, workers and
sweepers may run the same step at once. Locks taken here (:func:`lock_tenant`,
:func:`share_lock_open_batch`) are held until the caller's transaction ends.

Example::

    with store.session() as s:
        lock_tenant(s, "acme")
        waiting = queued_lines(s, "acme", exclude_batch_id="batch_abc")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias, TypedDict

from sqlalchemy import Row, bindparam, text
from sqlmodel import Session

from tidal.batch_jobs.models import BATCH_ACTIVE

AnyRow: TypeAlias = Row[*tuple[Any, ...]]
"""A row of a hand-written statement (its columns as the function's docstring lists them)."""

__all__ = [
    "AnyRow",
    "FinalKind",
    "LineResultRow",
    "batch_answers",
    "batch_open_state",
    "begin_chunk",
    "cancelling_batch_ids",
    "chunk_deliveries",
    "chunk_delivery",
    "chunk_spans",
    "chunks_in_flight",
    "claim_batch_final",
    "claim_chunks",
    "claim_job_advance",
    "claimed_chunks",
    "claimed_chunks_in_order",
    "close_chunks",
    "defer_chunks",
    "delete_file_record",
    "fail_unrun_lines",
    "finished_batch_ids",
    "heartbeat_chunk",
    "hold_final_claim",
    "line_usage",
    "lock_tenant",
    "mark_cancelling",
    "mark_tenant_served",
    "overdue_batch_ids",
    "pending_chunks",
    "pending_chunks_of_tenant",
    "pending_line_count",
    "pending_lines_of_chunk",
    "queued_lines",
    "release_final_claim",
    "release_job_claim",
    "release_stale_final_claims",
    "release_stale_publishing",
    "requeue_stale_running",
    "set_chunk_state",
    "settle_chunks",
    "share_lock_open_batch",
    "stuck_jobs",
    "waiting_tenants",
    "write_line_results",
]

# -- chunks: claiming and publishing --------------------------------------------------------------

_CLAIM = text(
    """UPDATE tidal_batch_chunks SET state = 'publishing', publish_claim = :t, published_at = :now
        WHERE batch_id = :b AND chunk_no IN :nos AND state = 'pending'"""
).bindparams(bindparam("nos", expanding=True))
_SETTLE = text(
    """UPDATE tidal_batch_chunks SET state = :new
        WHERE publish_claim = :t AND state = 'publishing' AND batch_id = :b AND chunk_no IN :nos"""
).bindparams(bindparam("nos", expanding=True))


def pending_chunks(session: Session, *, batch_id: str | None, limit: int) -> Sequence[AnyRow]:
    """Pending chunks of in-progress batches as (batch_id, chunk_no, queue_lane, priority), most
    urgent first, then in submission and chunk order (only ``batch_id``'s when given)."""
    where = ["c.state = 'pending'", "b.status = 'in_progress'"]
    params: dict[str, Any] = {"lim": limit}
    if batch_id is not None:
        where.append("c.batch_id = :b")
        params["b"] = batch_id
    return (
        session.connection()
        .execute(
            text(
                f"""SELECT c.batch_id, c.chunk_no, c.queue_lane, c.priority
                      FROM tidal_batch_chunks c JOIN tidal_batches b ON b.id = c.batch_id
                     WHERE {" AND ".join(where)}
                     ORDER BY c.priority DESC, b.seq, c.chunk_no LIMIT :lim"""
            ),
            params,
        )
        .all()
    )


def claim_chunks(session: Session, *, token: str, now: float, batch_id: str, chunk_nos: list[int]) -> None:
    """Claim ``batch_id``'s chunks ``chunk_nos`` for publishing under ``token``, those still
    pending only: one conditional UPDATE, so two publishers never claim the same chunk."""
    session.connection().execute(_CLAIM, {"t": token, "now": now, "b": batch_id, "nos": chunk_nos})


def claimed_chunks(session: Session, token: str) -> Sequence[AnyRow]:
    """The chunks ``token`` holds in ``publishing`` as (batch_id, chunk_no, queue_lane, priority):
    what the claim won (a duplicate message may have started one meanwhile)."""
    return (
        session.connection()
        .execute(
            text(
                """SELECT batch_id, chunk_no, queue_lane, priority FROM tidal_batch_chunks
                    WHERE publish_claim = :t AND state = 'publishing'"""
            ),
            {"t": token},
        )
        .all()
    )


def settle_chunks(session: Session, *, token: str, batch_id: str, chunk_nos: list[int], state: str) -> None:
    """Move ``token``'s ``publishing`` chunks of ``batch_id`` to ``state`` (``queued`` once the
    broker took them, ``pending`` again when it did not); only the claim's owner settles them."""
    session.connection().execute(_SETTLE, {"new": state, "t": token, "b": batch_id, "nos": chunk_nos})


def release_stale_publishing(session: Session, *, cut: float) -> int:
    """Chunks claimed for publishing before ``cut`` (their publisher died) go back to pending;
    returns how many."""
    return int(
        session.connection()
        .execute(
            text(
                """UPDATE tidal_batch_chunks SET state = 'pending'
                    WHERE state = 'publishing' AND published_at < :cut"""
            ),
            {"cut": cut},
        )
        .rowcount
        or 0
    )


def requeue_stale_running(session: Session, *, now: float, cut: float) -> int:
    """Running chunks whose last heartbeat is older than ``cut`` go back to pending (created
    ``now``); returns how many."""
    return int(
        session.connection()
        .execute(
            text(
                """UPDATE tidal_batch_chunks SET state = 'pending', created_at = :now
                    WHERE state = 'running' AND heartbeat_at < :cut"""
            ),
            {"now": now, "cut": cut},
        )
        .rowcount
        or 0
    )


# -- tenants' windows -----------------------------------------------------------------------------

_ENSURE_TENANT = text(
    """INSERT INTO tidal_batch_tenants (tenant, dispatched_at) VALUES (:t, 0)
       ON CONFLICT (tenant) DO NOTHING"""
)
_LOCK_TENANT = text("UPDATE tidal_batch_tenants SET dispatched_at = dispatched_at WHERE tenant = :t")

# Only open batches hold chunks in flight: a cancelled or expired batch's queued chunks are
# dropped by the first worker that takes them, and a message the broker lost cannot shrink a
# tenant's window for longer than its batch lives.
_OPEN = "b.status = 'in_progress' AND b.final_claim IS NULL"
_SPAN = "(c.last_line - c.first_line + 1)"
_IN_FLIGHT = "c.state IN ('publishing', 'queued', 'running')"


def lock_tenant(session: Session, tenant: str) -> None:
    """Hold ``tenant``'s row in ``tidal_batch_tenants`` locked until ``session`` commits: on
    PostgreSQL a row lock (other tenants go on), on SQLite the database's write lock. Taken by
    whoever decides from the tenant's totals (its dispatchers, its submissions), so that two such
    decisions never both act on the same stale count. Call it before reading those totals: on
    SQLite a transaction that read first may not take the write lock later."""
    conn = session.connection()
    conn.execute(_ENSURE_TENANT, {"t": tenant})
    conn.execute(_LOCK_TENANT, {"t": tenant})


def _filters(lane: str | None, tenant: str | None) -> tuple[str, dict[str, Any]]:
    where, params = "", {}
    if lane is not None:
        where += " AND c.queue_lane = :l"
        params["l"] = lane
    if tenant is not None:
        where += " AND b.tenant = :t"
        params["t"] = tenant
    return where, params


def waiting_tenants(session: Session, *, lane: str | None, tenant: str | None) -> Sequence[AnyRow]:
    """(tenant, lane, top priority, last served) for each tenant and lane with pending chunks of
    open batches (only ``lane``'s, ``tenant``'s when given); read without a lock."""
    where, params = _filters(lane, tenant)
    return (
        session.connection()
        .execute(
            text(
                f"""SELECT b.tenant, c.queue_lane, MAX(c.priority), COALESCE(MAX(d.dispatched_at), 0)
                      FROM tidal_batch_chunks c JOIN tidal_batches b ON b.id = c.batch_id
                      LEFT JOIN tidal_batch_tenants d ON d.tenant = b.tenant
                     WHERE c.state = 'pending' AND {_OPEN}{where}
                     GROUP BY b.tenant, c.queue_lane"""
            ),
            params,
        )
        .all()
    )


def chunks_in_flight(session: Session, *, lane: str | None, tenant: str | None) -> Sequence[AnyRow]:
    """(tenant, lane, chunks, lines) in flight (publishing, queued or running) of open batches;
    exact only under the tenant's lock (:func:`lock_tenant`)."""
    where, params = _filters(lane, tenant)
    return (
        session.connection()
        .execute(
            text(
                f"""SELECT b.tenant, c.queue_lane, COUNT(*), COALESCE(SUM({_SPAN}), 0)
                      FROM tidal_batch_chunks c JOIN tidal_batches b ON b.id = c.batch_id
                     WHERE {_IN_FLIGHT} AND {_OPEN}{where}
                     GROUP BY b.tenant, c.queue_lane"""
            ),
            params,
        )
        .all()
    )


def pending_chunks_of_tenant(session: Session, *, tenant: str, lane: str, limit: int) -> Sequence[AnyRow]:
    """``tenant``'s next pending chunks on ``lane`` as (batch_id, chunk_no, priority, lines
    spanned): most urgent first, then in batch order, the order its window takes them in."""
    return (
        session.connection()
        .execute(
            text(
                f"""SELECT c.batch_id, c.chunk_no, c.priority, {_SPAN}
                      FROM tidal_batch_chunks c JOIN tidal_batches b ON b.id = c.batch_id
                     WHERE c.state = 'pending' AND {_OPEN} AND b.tenant = :t AND c.queue_lane = :l
                     ORDER BY c.priority DESC, b.seq, c.chunk_no LIMIT :lim"""
            ),
            {"t": tenant, "l": lane, "lim": limit},
        )
        .all()
    )


def claimed_chunks_in_order(session: Session, *, token: str, batch_ids: list[str]) -> Sequence[AnyRow]:
    """The chunks of ``batch_ids`` that ``token`` holds in ``publishing`` as (batch_id, chunk_no,
    queue_lane, priority), most urgent first."""
    return (
        session.connection()
        .execute(
            text(
                """SELECT c.batch_id, c.chunk_no, c.queue_lane, c.priority FROM tidal_batch_chunks c
                    WHERE c.publish_claim = :tok AND c.state = 'publishing' AND c.batch_id IN :bids
                    ORDER BY c.priority DESC, c.chunk_no"""
            ).bindparams(bindparam("bids", expanding=True)),
            {"tok": token, "bids": batch_ids},
        )
        .all()
    )


def mark_tenant_served(session: Session, tenant: str, *, now: float) -> None:
    """Record that ``tenant`` was served ``now``: the next top-up serves the others first."""
    session.connection().execute(
        text("UPDATE tidal_batch_tenants SET dispatched_at = :now WHERE tenant = :t"),
        {"now": now, "t": tenant},
    )


# -- chunks: running (workers) --------------------------------------------------------------------


def begin_chunk(session: Session, *, batch_id: str, chunk_no: int, worker: str, now: float) -> None:
    """Count one more delivery of the chunk and mark it ``running`` on ``worker`` (its first
    heartbeat ``now``)."""
    session.connection().execute(
        text(
            """UPDATE tidal_batch_chunks
                  SET deliveries = deliveries + 1, state = 'running', worker = :w, heartbeat_at = :now
                WHERE batch_id = :b AND chunk_no = :c"""
        ),
        {"w": worker, "now": now, "b": batch_id, "c": chunk_no},
    )


def chunk_delivery(session: Session, *, batch_id: str, chunk_no: int) -> AnyRow | None:
    """The chunk's (deliveries, releases, queue_lane), or None when this store has no such chunk."""
    return (
        session.connection()
        .execute(
            text(
                "SELECT deliveries, releases, queue_lane FROM tidal_batch_chunks WHERE batch_id = :b AND chunk_no = :c"
            ),
            {"b": batch_id, "c": chunk_no},
        )
        .first()
    )


def pending_lines_of_chunk(session: Session, *, batch_id: str, chunk_no: int) -> Sequence[AnyRow]:
    """The chunk's lines still without a result as (line_no, custom_id, body), in line order."""
    return (
        session.connection()
        .execute(
            text(
                """SELECT line_no, custom_id, body FROM tidal_batch_lines
                    WHERE batch_id = :b AND chunk_no = :c AND state = 'pending' ORDER BY line_no"""
            ),
            {"b": batch_id, "c": chunk_no},
        )
        .all()
    )


def set_chunk_state(
    session: Session, *, batch_id: str, chunk_no: int, state: str, released: bool = False
) -> None:
    """Set the chunk's state; ``released`` also counts one release (a chunk handed back unrun)."""
    extra = ", releases = releases + 1" if released else ""
    session.connection().execute(
        text(f"UPDATE tidal_batch_chunks SET state = :s{extra} WHERE batch_id = :b AND chunk_no = :c"),
        {"s": state, "b": batch_id, "c": chunk_no},
    )


def heartbeat_chunk(session: Session, *, batch_id: str, chunk_no: int, now: float) -> None:
    """Record that the chunk's worker is alive ``now`` (see :func:`requeue_stale_running`)."""
    session.connection().execute(
        text("UPDATE tidal_batch_chunks SET heartbeat_at = :now WHERE batch_id = :b AND chunk_no = :c"),
        {"now": now, "b": batch_id, "c": chunk_no},
    )


def batch_open_state(session: Session, batch_id: str) -> AnyRow | None:
    """The batch's (status, final_claim), or None when there is no such batch."""
    return (
        session.connection()
        .execute(text("SELECT status, final_claim FROM tidal_batches WHERE id = :b"), {"b": batch_id})
        .first()
    )


# -- line results ---------------------------------------------------------------------------------


class LineResultRow(TypedDict):
    """The parameters of one line's result (:func:`write_line_results`)."""

    batch_id: str
    line_no: int
    state: str
    status_code: int | None
    request_id: str | None
    response_body: str | None
    error_json: str | None
    input_tokens: int
    output_tokens: int
    cached_tokens: int


_UPDATE_LINE = text(
    """
    UPDATE tidal_batch_lines
       SET state = :state, status_code = :status_code, request_id = :request_id,
           response_body = :response_body, error_json = :error_json,
           input_tokens = :input_tokens, output_tokens = :output_tokens, cached_tokens = :cached_tokens
     WHERE batch_id = :batch_id AND line_no = :line_no AND state = 'pending'
       AND EXISTS (SELECT 1 FROM tidal_batches WHERE id = :batch_id AND final_claim IS NULL)
    """
).bindparams(bindparam("batch_id"))


def write_line_results(session: Session, rows: list[LineResultRow]) -> int:
    """Write each result to its line if the line is still pending and no finaliser has claimed
    the batch (a line answered twice counts once); returns how many were written."""
    written = 0
    for p in rows:
        written += session.connection().execute(_UPDATE_LINE, p).rowcount or 0
    return written


def share_lock_open_batch(session: Session, batch_id: str) -> bool:
    """PostgreSQL only: share-lock the batch row until the transaction ends (the finaliser's
    claim waits for it); True when the batch exists and no finaliser has claimed it."""
    row = (
        session.connection()
        .execute(text("SELECT final_claim FROM tidal_batches WHERE id = :b FOR SHARE"), {"b": batch_id})
        .first()
    )
    return row is not None and row[0] is None


# -- finalising -----------------------------------------------------------------------------------

FinalKind = Literal["complete", "cancel", "expire"]

# kind -> (final status, the condition under which a finaliser may claim the batch)
_FINAL_CLAIMS: dict[FinalKind, tuple[str, str]] = {
    "complete": (
        "completed",
        """status = 'in_progress' AND NOT EXISTS
           (SELECT 1 FROM tidal_batch_lines WHERE batch_id = :b AND state = 'pending')""",
    ),
    "cancel": ("cancelled", "status = 'cancelling'"),
    "expire": ("expired", "status IN ('validating', 'in_progress') AND expires_at <= :nowi"),
}


def claim_batch_final(session: Session, *, batch_id: str, kind: FinalKind, token: str, now: float) -> bool:
    """Claim the batch for finalising under ``token`` if nobody has and ``kind``'s condition
    holds (a conditional UPDATE: exactly one finaliser wins); True when this one did."""
    final_status, condition = _FINAL_CLAIMS[kind]
    set_finalizing = ", status = 'finalizing', finalizing_at = :nowi" if kind == "complete" else ""
    stmt = text(
        f"""UPDATE tidal_batches
               SET final_claim = :t, final_claimed_at = :now, final_status = :fs{set_finalizing}
             WHERE id = :b AND final_claim IS NULL AND {condition}"""
    )
    n = (
        session.connection()
        .execute(stmt, {"t": token, "now": now, "nowi": int(now), "fs": final_status, "b": batch_id})
        .rowcount
    )
    return n == 1


def fail_unrun_lines(session: Session, batch_id: str, *, error_json: str) -> None:
    """Fail every line of the batch still pending with ``error_json`` (a cancelled or expired
    batch's lines that never ran)."""
    session.connection().execute(
        text(
            "UPDATE tidal_batch_lines SET state = 'failed', error_json = :e "
            "WHERE batch_id = :b AND state = 'pending'"
        ),
        {"e": error_json, "b": batch_id},
    )


def line_usage(session: Session, batch_id: str) -> AnyRow:
    """The batch's (done lines, failed lines, input, output and cached tokens); SUMs of no rows
    are NULL."""
    return (
        session.connection()
        .execute(
            text(
                """SELECT SUM(CASE WHEN state = 'done' THEN 1 ELSE 0 END),
                      SUM(CASE WHEN state = 'failed' THEN 1 ELSE 0 END),
                      COALESCE(SUM(input_tokens), 0), COALESCE(SUM(output_tokens), 0),
                      COALESCE(SUM(cached_tokens), 0)
                 FROM tidal_batch_lines WHERE batch_id = :b"""
            ),
            {"b": batch_id},
        )
        .one()
    )


def close_chunks(session: Session, batch_id: str) -> None:
    """Mark the final batch's chunks ``done`` (dead-lettered ones stay ``dead``)."""
    session.connection().execute(
        text("UPDATE tidal_batch_chunks SET state = 'done' WHERE batch_id = :b AND state <> 'dead'"),
        {"b": batch_id},
    )


def release_final_claim(session: Session, batch_id: str, *, token: str) -> None:
    """Give up ``token``'s finalising claim (only that one), back to ``in_progress`` where it was
    finalising."""
    session.connection().execute(
        text(
            """UPDATE tidal_batches
                  SET final_claim = NULL, final_claimed_at = NULL,
                      status = CASE WHEN status = 'finalizing' THEN 'in_progress' ELSE status END
                WHERE id = :b AND final_claim = :t"""
        ),
        {"b": batch_id, "t": token},
    )


def release_stale_final_claims(session: Session, *, cut: float) -> int:
    """Release finalising claims taken before ``cut`` on batches not yet final (their finaliser
    died); returns how many."""
    return int(
        session.connection()
        .execute(
            text(
                """UPDATE tidal_batches
                      SET final_claim = NULL, final_claimed_at = NULL,
                          status = CASE WHEN status = 'finalizing' THEN 'in_progress' ELSE status END
                    WHERE final_claim IS NOT NULL AND final_claimed_at < :cut
                      AND status NOT IN ('completed', 'failed', 'expired', 'cancelled')"""
            ),
            {"cut": cut},
        )
        .rowcount
        or 0
    )


# -- housekeeping: batches to finalise ------------------------------------------------------------


def _ids(session: Session, sql: str, **params: object) -> list[str]:
    return [r[0] for r in session.connection().execute(text(sql), params).all()]


def overdue_batch_ids(session: Session, *, now: int) -> list[str]:
    """Unclaimed batches past their completion window at ``now``: to expire."""
    return _ids(
        session,
        """SELECT id FROM tidal_batches WHERE status IN ('validating', 'in_progress')
            AND final_claim IS NULL AND expires_at <= :now""",
        now=now,
    )


def cancelling_batch_ids(session: Session) -> list[str]:
    """Unclaimed batches being cancelled: to finalise as cancelled."""
    return _ids(session, "SELECT id FROM tidal_batches WHERE status = 'cancelling' AND final_claim IS NULL")


def finished_batch_ids(session: Session) -> list[str]:
    """Unclaimed in-progress batches without a pending line: to finalise as completed."""
    return _ids(
        session,
        """SELECT b.id FROM tidal_batches b WHERE b.status = 'in_progress' AND b.final_claim IS NULL
            AND NOT EXISTS (SELECT 1 FROM tidal_batch_lines l
                             WHERE l.batch_id = b.id AND l.state = 'pending')""",
    )


# -- files and batches (the service) --------------------------------------------------------------


def delete_file_record(session: Session, *, file_id: str, tenant: str) -> None:
    """Delete the file's record (only ``tenant``'s); its bytes are the file store's."""
    session.connection().execute(
        text("DELETE FROM tidal_files WHERE id = :i AND tenant = :t"), {"i": file_id, "t": tenant}
    )


def queued_lines(session: Session, tenant: str, *, exclude_batch_id: str) -> int:
    """Lines of ``tenant``'s unfinished batches other than ``exclude_batch_id``; exact only under
    the tenant's lock (:func:`lock_tenant`)."""
    return int(
        session.connection()
        .execute(
            text(
                """SELECT COALESCE(SUM(total), 0) FROM tidal_batches
                    WHERE tenant = :t AND status IN :active AND id != :b"""
            ).bindparams(bindparam("active", expanding=True)),
            {"t": tenant, "active": sorted(BATCH_ACTIVE), "b": exclude_batch_id},
        )
        .scalar_one()
    )


def chunk_spans(session: Session, batch_id: str) -> Sequence[AnyRow]:
    """(chunk_no, first line_no, last line_no) of each chunk of the batch's inserted lines."""
    return (
        session.connection()
        .execute(
            text(
                "SELECT chunk_no, MIN(line_no), MAX(line_no) FROM tidal_batch_lines WHERE batch_id = :b GROUP BY chunk_no"
            ),
            {"b": batch_id},
        )
        .all()
    )


def mark_cancelling(session: Session, *, batch_id: str, tenant: str, now: int) -> int:
    """Move ``tenant``'s batch to ``cancelling`` if it is still validating or in progress and no
    finaliser has claimed it; returns 1 when it did, else 0."""
    return (
        session.connection()
        .execute(
            text(
                """UPDATE tidal_batches SET status = 'cancelling', cancelling_at = :now
                WHERE id = :b AND tenant = :t AND status IN ('validating', 'in_progress')
                  AND final_claim IS NULL"""
            ),
            {"now": now, "b": batch_id, "t": tenant},
        )
        .rowcount
    )


# -- jobs -----------------------------------------------------------------------------------------


def claim_job_advance(session: Session, *, job_id: str, batch_id: str, claim: str) -> int:
    """Claim the advance of the in-progress job whose current batch is ``batch_id`` (nobody else
    holds it); returns 1 when this caller won, else 0."""
    return (
        session.connection()
        .execute(
            text(
                """UPDATE tidal_jobs SET advance_claim = :t
                WHERE id = :j AND batch_id = :b AND status = 'in_progress' AND advance_claim IS NULL"""
            ),
            {"t": claim, "j": job_id, "b": batch_id},
        )
        .rowcount
    )


def release_job_claim(session: Session, *, job_id: str, claim: str) -> None:
    """Drop the job's advance claim if it is still ``claim`` (a stale one)."""
    session.connection().execute(
        text("UPDATE tidal_jobs SET advance_claim = NULL WHERE id = :j AND advance_claim = :c"),
        {"j": job_id, "c": claim},
    )


def batch_answers(session: Session, batch_id: str) -> Sequence[AnyRow]:
    """(custom_id, state, response_body, error_json) of every line of the batch."""
    return (
        session.connection()
        .execute(
            text(
                "SELECT custom_id, state, response_body, error_json FROM tidal_batch_lines WHERE batch_id = :b"
            ),
            {"b": batch_id},
        )
        .all()
    )


def stuck_jobs(session: Session) -> Sequence[AnyRow]:
    """(job id, advance claim, batch id) of in-progress jobs whose current batch is final."""
    return (
        session.connection()
        .execute(
            text(
                """SELECT j.id, j.advance_claim, b.id FROM tidal_jobs j JOIN tidal_batches b ON b.id = j.batch_id
                WHERE j.status = 'in_progress' AND b.status IN ('completed', 'failed', 'expired', 'cancelled')"""
            )
        )
        .all()
    )


# -- benchmarks -----------------------------------------------------------------------------------


def hold_final_claim(session: Session, batch_id: str) -> None:
    """Claim the batch for a finaliser named ``bench`` that never finishes: it stays open and
    takes no more results (``tidal bench batch`` times the dispatch of chunks with nothing to run)."""
    session.connection().execute(
        text("UPDATE tidal_batches SET final_claim = 'bench' WHERE id = :b"), {"b": batch_id}
    )


def defer_chunks(session: Session, batch_id: str, *, created_at: float) -> None:
    """Set the ``created_at`` of every chunk of the batch."""
    session.connection().execute(
        text("UPDATE tidal_batch_chunks SET created_at = :later WHERE batch_id = :b"),
        {"later": created_at, "b": batch_id},
    )


def chunk_deliveries(session: Session, batch_id: str) -> int:
    """How many times the batch's chunks were delivered to workers, all together."""
    return int(
        session.connection()
        .execute(
            text("SELECT COALESCE(SUM(deliveries), 0) FROM tidal_batch_chunks WHERE batch_id = :b"),
            {"b": batch_id},
        )
        .scalar_one()
    )


def pending_line_count(session: Session) -> int:
    """Lines of every batch still without a result."""
    return int(
        session.connection()
        .execute(text("SELECT COUNT(*) FROM tidal_batch_lines WHERE state = 'pending'"))
        .scalar_one()
    )
