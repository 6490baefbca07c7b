"""Errors the batch tier's services raise; the gateway turns them into OpenAI-shaped answers."""

from __future__ import annotations

__all__ = [
    "BatchTierError",
    "Conflict",
    "Forbidden",
    "InvalidRequest",
    "LimitExceeded",
    "NotFound",
    "TooLarge",
]


class BatchTierError(Exception):
    """A request the batch tier refuses, with the HTTP status and OpenAI error fields to answer."""

    status = 400
    default_code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code


class InvalidRequest(BatchTierError):
    status = 400


class Forbidden(BatchTierError):
    status = 403
    default_code = "permission_denied"


class NotFound(BatchTierError):
    """Unknown *or another tenant's* object: the same 404, so ids leak nothing."""

    status = 404
    default_code = "not_found"


class Conflict(BatchTierError):
    status = 409
    default_code = "conflict"


class TooLarge(BatchTierError):
    status = 413
    default_code = "file_too_large"


class LimitExceeded(BatchTierError):
    status = 429
    default_code = "limit_exceeded"
