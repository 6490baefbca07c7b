"""Checking a batch input file line by line, as OpenAI does: every offending line is named.

A line is ``{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}``;
the body must name a served ``model`` and must not ask to stream.

Example::

    report = validate_batch_file(path, endpoint="/v1/chat/completions", models={"tiny"}, max_lines=50_000)
    if report.errors: ...   # [BatchErrorItem(code="duplicate_custom_id", line=7, ...), ...]
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Set
from dataclasses import dataclass, field
from typing import Any

from tidal.batch_jobs.files import Readable
from tidal.batch_jobs.models import BatchErrorItem

__all__ = [
    "MAX_CUSTOM_ID",
    "MAX_REPORTED_ERRORS",
    "SUPPORTED_ENDPOINTS",
    "ParsedLine",
    "ValidationReport",
    "iter_valid_lines",
    "validate_batch_file",
]

SUPPORTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID = 512
# The batch row holds the errors; past this many, one more entry says how many were left out.
MAX_REPORTED_ERRORS = 1000

_REQUIRED_INPUT: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "/v1/chat/completions": ("messages", list),
    "/v1/completions": ("prompt", (str, list)),
    "/v1/embeddings": ("input", (str, list)),
}


@dataclass(frozen=True)
class ParsedLine:
    line_no: int
    custom_id: str
    body: dict[str, Any]


@dataclass
class ValidationReport:
    lines: int = 0
    errors: list[BatchErrorItem] = field(default_factory=list)
    error_count: int = 0
    models: set[str] = field(default_factory=set)

    def add(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(BatchErrorItem(code=code, line=line, message=message, param=param))

    def finish(self) -> list[BatchErrorItem]:
        out = list(self.errors)
        if self.error_count > len(self.errors):
            more = self.error_count - len(self.errors)
            out.append(BatchErrorItem(code="too_many_errors", message=f"{more} more errors were not listed"))
        return out


def _raw_lines(source: Readable) -> Iterator[tuple[int, bytes]]:
    with source.open("rb") as f:
        yield from enumerate(f, start=1)


def _check(
    no: int,
    raw: bytes,
    *,
    endpoint: str,
    models: Set[str],
    report: ValidationReport,
    other_kind: Set[str] = frozenset(),
) -> ParsedLine | None:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        report.add(no, "invalid_json_line", f"Line {no} is not valid JSON: {str(exc)[:120]}")
        return None
    if not isinstance(obj, dict):
        report.add(no, "invalid_json_line", f"Line {no} is not a JSON object.")
        return None
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        report.add(no, "missing_required_parameter", f"Line {no} has no string 'custom_id'.", "custom_id")
        return None
    if len(cid) > MAX_CUSTOM_ID:
        report.add(no, "invalid_value", f"Line {no}: custom_id is longer than {MAX_CUSTOM_ID}.", "custom_id")
        return None
    if obj.get("method") != "POST":
        report.add(no, "invalid_method", f"Line {no}: method must be 'POST'.", "method")
        return None
    if obj.get("url") != endpoint:
        report.add(
            no,
            "mismatched_endpoint",
            f"Line {no}: url {str(obj.get('url'))[:80]!r} does not match the batch's endpoint {endpoint!r}.",
            "url",
        )
        return None
    body = obj.get("body")
    if not isinstance(body, dict):
        report.add(no, "invalid_body", f"Line {no}: body must be a JSON object.", "body")
        return None
    model = body.get("model")
    if isinstance(model, str) and model in other_kind:
        report.add(
            no,
            "model_not_supported",
            f"Line {no}: model {model[:80]!r} cannot serve {endpoint} "
            f"({'an embedding model' if endpoint != '/v1/embeddings' else 'not an embedding model'}).",
            "body.model",
        )
        return None
    if not isinstance(model, str) or model not in models:
        known = ", ".join(sorted(models)) or "none"
        report.add(
            no,
            "model_not_found",
            f"Line {no}: model {str(model)[:80]!r} is not served here (served: {known}).",
            "body.model",
        )
        return None
    if body.get("stream"):
        report.add(no, "invalid_value", f"Line {no}: batch requests must not stream.", "body.stream")
        return None
    key, kinds = _REQUIRED_INPUT[endpoint]
    if not isinstance(body.get(key), kinds):
        report.add(no, "missing_required_parameter", f"Line {no}: body needs '{key}'.", f"body.{key}")
        return None
    report.models.add(model)
    return ParsedLine(no, cid, body)


def validate_batch_file(
    source: Readable,
    *,
    endpoint: str,
    models: Set[str],
    max_lines: int,
    other_kind: Set[str] = frozenset(),
) -> ValidationReport:
    """Check every line; the report names each offending line (1-based, as in an editor).
    ``models`` are those that serve ``endpoint``; a line naming one of ``other_kind`` (served, but
    not for this endpoint: a chat model in an embeddings batch) is ``model_not_supported``."""
    report = ValidationReport()
    seen: dict[str, int] = {}
    for no, raw in _raw_lines(source):
        if not raw.strip():
            continue  # blank lines (a trailing newline) carry nothing
        report.lines += 1
        if report.lines > max_lines:
            report.add(no, "too_many_requests", f"The file has more than {max_lines} requests.")
            break
        parsed = _check(no, raw, endpoint=endpoint, models=models, report=report, other_kind=other_kind)
        if parsed is None:
            continue
        first = seen.get(parsed.custom_id)
        if first is not None:
            report.add(
                no,
                "duplicate_custom_id",
                f"Line {no}: custom_id {parsed.custom_id[:80]!r} was already used on line {first}.",
                "custom_id",
            )
        else:
            seen[parsed.custom_id] = no
    if report.lines == 0 and report.error_count == 0:
        report.add(None, "empty_file", "The input file has no requests.")
    return report


def iter_valid_lines(source: Readable, *, endpoint: str, models: Set[str]) -> Iterator[ParsedLine]:
    """The lines of a file that :func:`validate_batch_file` accepted (second pass, streaming)."""
    scratch = ValidationReport()
    for no, raw in _raw_lines(source):
        if not raw.strip():
            continue
        parsed = _check(no, raw, endpoint=endpoint, models=models, report=scratch)
        if parsed is not None:
            yield parsed
