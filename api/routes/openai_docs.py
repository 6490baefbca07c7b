"""OpenAPI descriptions shared by the proxied endpoints (errors are OpenAI-shaped)."""

from __future__ import annotations

from typing import Any

__all__ = ["ERROR_SCHEMA", "PROXY_RESPONSES"]

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}

_ERR = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}

PROXY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The replica's answer: JSON, or `text/event-stream` chunks ending in `data: [DONE]`.",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    400: {"description": "Invalid request, or above the feature's context cap", **_ERR},
    401: {"description": "Missing or wrong API key", **_ERR},
    403: {"description": "The key may not use this feature", **_ERR},
    404: {"description": "Unknown model", **_ERR},
    413: {"description": "Body too large", **_ERR},
    429: {"description": "Pool saturated; see `Retry-After`", **_ERR},
    502: {"description": "The replica failed", **_ERR},
    503: {"description": "No replica can take the request now", **_ERR},
}
