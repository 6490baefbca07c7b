"""Logs an operator can follow: text or JSON lines, each carrying the request id it belongs to.

The gateway gives every request an id (``X-Request-Id``, returned to the client and sent to the
replica, which makes it the engine's request id); a batch line's is ``batch-<batch>-<custom_id>``,
set by the worker that sends it. While a request is handled its id sits in :data:`REQUEST_ID`, so
every log line written meanwhile names it. With the access log on (``TIDAL_ACCESS_LOG=true``),
the gateway, the workers and the simulator write one line per request on the ``tidal.access``
logger: a request is then followed from gateway to replica, and a batch line from gateway to
worker to replica, by grepping one id.

Example::

    TIDAL_LOG_FORMAT=json TIDAL_ACCESS_LOG=true tidal up
    # {"ts": "...", "level": "INFO", "logger": "tidal.access", "msg": "request",
    #  "request_id": "tidal-1f", "status": 200, "replica": "sim-i0", ...}
"""

from __future__ import annotations

import json
import logging
import os
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "ACCESS",
    "FORMATS",
    "REQUEST_ID",
    "JsonFormatter",
    "RequestIdFilter",
    "access_log_enabled",
    "configure",
    "uvicorn_log_config",
]

FORMATS = ("text", "json")
REQUEST_ID: ContextVar[str | None] = ContextVar("tidal_request_id", default=None)
# One line per request (gateway), per batch line (worker) and per request served (simulator).
ACCESS = logging.getLogger("tidal.access")

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What every LogRecord has: anything else on a record came through ``extra`` and is logged.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on every record (``None`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``, the
    ``request_id`` when there is one, the fields passed as ``extra``, and ``exc`` for a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def access_log_enabled(env: dict[str, str] | None = None) -> bool:
    """``TIDAL_ACCESS_LOG`` set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    value = (env if env is not None else os.environ).get("TIDAL_ACCESS_LOG", "")
    return value.strip().lower() in {"1", "true", "yes", "on"}


def configure(level: str = "INFO", fmt: str = "text", *, access: bool | None = None) -> None:
    """Set up the root logger of a Tidal process: ``fmt`` ``text`` or ``json``, every record
    carrying its request id; the access log on or off (default: ``TIDAL_ACCESS_LOG``)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
    on = access_log_enabled() if access is None else access
    ACCESS.setLevel(logging.INFO if on else logging.WARNING)


def uvicorn_log_config() -> dict[str, Any] | None:
    """What to pass uvicorn as ``log_config``: its own text handlers, or with JSON logs
    (``TIDAL_LOG_FORMAT=json``) none, so its lines go through the root logger as JSON too."""
    if os.environ.get("TIDAL_LOG_FORMAT") == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
