"""Writing line results idempotently, and the OpenAI output/error line format.

A result is an UPDATE of its line ``WHERE state = 'pending'`` and only while no finaliser has
claimed the batch, so a line answered twice (a redelivered chunk, a duplicate message) counts
once, and nothing lands after the output files were written. On PostgreSQL the writer also holds
a share lock on the batch row until it commits: the finaliser's claim (an exclusive row lock)
waits for every writer already past the check.

Example::

    record_results(store, "batch_abc", [LineResult.ok(3, 200, "req-1", raw_body, usage)])
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tidal.batch_jobs import queries
from tidal.batch_jobs.queries import LineResultRow
from tidal.batch_jobs.store import Store

__all__ = ["LineResult", "error_line", "output_line", "record_results", "request_line_id"]


@dataclass(frozen=True)
class LineResult:
    """What happened to one line: an HTTP answer (any status) or a non-HTTP error."""

    line_no: int
    succeeded: bool
    status_code: int | None = None
    request_id: str | None = None
    response_body: str | None = None  # the replica's JSON, kept as text (never re-encoded)
    error: dict[str, str] | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def ok(cls, line_no: int, request_id: str, body: str, usage: dict[str, Any] | None) -> LineResult:
        u = usage or {}
        details = u.get("prompt_tokens_details") or {}
        return cls(
            line_no,
            True,
            200,
            request_id,
            body,
            None,
            int(u.get("prompt_tokens") or 0),
            int(u.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
        )

    @classmethod
    def http_error(cls, line_no: int, status: int, request_id: str, body: str) -> LineResult:
        return cls(line_no, False, status, request_id, body)

    @classmethod
    def failure(cls, line_no: int, code: str, message: str) -> LineResult:
        return cls(line_no, False, error={"code": code, "message": message[:1000]})


def record_results(store: Store, batch_id: str, results: list[LineResult]) -> int:
    """Write results for lines still pending; returns how many were recorded now."""
    if not results:
        return 0
    params: list[LineResultRow] = [
        {
            "batch_id": batch_id,
            "line_no": r.line_no,
            "state": "done" if r.succeeded else "failed",
            "status_code": r.status_code,
            "request_id": r.request_id,
            "response_body": r.response_body,
            "error_json": json.dumps(r.error) if r.error else None,
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens,
        }
        for r in results
    ]
    with store.session() as s:
        if store.dialect == "postgresql" and not queries.share_lock_open_batch(s, batch_id):
            return 0
        return queries.write_line_results(s, params)


def request_line_id(batch_id: str, custom_id: str) -> str:
    """Stable ``batch_req_…`` id of one output line."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:24]


def output_line(batch_id: str, custom_id: str, status: int, request_id: str | None, body: str) -> str:
    """One line of an output (or HTTP-error) file; ``body`` is inserted as the replica sent it."""
    head = json.dumps({"id": request_line_id(batch_id, custom_id), "custom_id": custom_id})[:-1]
    resp = json.dumps({"status_code": status, "request_id": request_id})[:-1]
    return f'{head}, "response": {resp}, "body": {body or "null"}}}, "error": null}}\n'


def error_line(batch_id: str, custom_id: str, error: dict[str, Any]) -> str:
    """One line of an error file for a request that failed without an HTTP answer."""
    return (
        json.dumps(
            {
                "id": request_line_id(batch_id, custom_id),
                "custom_id": custom_id,
                "response": None,
                "error": {"code": error.get("code"), "message": error.get("message")},
            }
        )
        + "\n"
    )
