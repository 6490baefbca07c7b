"""Typed errors from a replica, each saying whether the same request may go to another replica.

::

    ReplicaError                      retry_safe
     ├── ReplicaUnavailable           True   connect refused/reset, 429/502/503/504, engine dead
     ├── ReplicaTimeout               True   no response (or no first byte) in time
     ├── ReplicaServerError           True   500 before any output was produced
     ├── ReplicaRequestError          False  4xx: the request itself is wrong; another replica says the same
     │    └── ReplicaModelNotFound    True   404 for the model: another replica may serve it (adapter not loaded)
     └── ReplicaStreamError           False  failed after output was streamed; only the client may retry
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ReplicaError",
    "ReplicaModelNotFound",
    "ReplicaRequestError",
    "ReplicaServerError",
    "ReplicaStreamError",
    "ReplicaTimeout",
    "ReplicaUnavailable",
    "error_from_status",
]


class ReplicaError(Exception):
    """Base of every replica failure."""

    retry_safe: bool = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        body: dict[str, Any] | None = None,
        replica: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body
        self.replica = replica

    def __str__(self) -> str:
        where = f" [{self.replica}]" if self.replica else ""
        code = f" (HTTP {self.status})" if self.status is not None else ""
        return f"{self.message}{code}{where}"


class ReplicaUnavailable(ReplicaError):
    """The replica cannot take the request now; another one may."""

    retry_safe = True


class ReplicaTimeout(ReplicaError):
    """The replica did not answer in time."""

    retry_safe = True


class ReplicaServerError(ReplicaError):
    """The replica failed with a 5xx before producing output."""

    retry_safe = True


class ReplicaRequestError(ReplicaError):
    """The replica rejected the request itself (4xx)."""

    retry_safe = False


class ReplicaModelNotFound(ReplicaRequestError):
    """The replica does not serve the requested model or adapter (yet)."""

    retry_safe = True


class ReplicaStreamError(ReplicaError):
    """The replica failed after output had been streamed to the caller."""

    retry_safe = False


def _message_of(body: dict[str, Any] | None, fallback: str) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    return fallback


def error_from_status(status: int, body: dict[str, Any] | None, text: str, replica: str = "") -> ReplicaError:
    """Map an HTTP error answer from a replica to the typed error."""
    message = _message_of(body, text.strip()[:500] or f"HTTP {status}")
    cls: type[ReplicaError]
    if status == 404 and "model" in message.lower():
        cls = ReplicaModelNotFound
    elif status in (429, 502, 503, 504, 529):
        cls = ReplicaUnavailable
    elif status == 408:
        cls = ReplicaTimeout
    elif 400 <= status < 500:
        cls = ReplicaRequestError
    else:
        cls = ReplicaServerError
    return cls(message, status=status, body=body, replica=replica)
