"""Request models of the OpenAI-compatible endpoints.

They check what the gateway itself relies on (model, messages, stream, token limits, user) with
bounds, and let every other OpenAI or vLLM sampling field through to the replica (which validates
it), except the few the gateway must own or refuse: ``priority`` and ``request_id`` are set by
the gateway, ``logits_processors`` and ``kv_transfer_params`` are refused (they make a vLLM
server load code or reach other servers), and media parts must be inline ``data:`` URLs so that no
request can make a replica fetch an address of the caller's choosing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "EmbeddingRequest",
    "ModelCard",
    "ModelList",
    "REFUSED_FIELDS",
]

REFUSED_FIELDS = ("logits_processors", "kv_transfer_params", "vllm_xargs")
_GATEWAY_FIELDS = ("priority", "request_id")
_MEDIA_KEYS = ("image_url", "video_url", "audio_url", "input_audio", "file")

ModelName = Annotated[str, Field(min_length=1, max_length=256)]
MaxTokens = Annotated[int, Field(ge=1, le=10_000_000)]


def _check_media(part: dict[str, Any]) -> None:
    for key in _MEDIA_KEYS:
        value = part.get(key)
        url = value.get("url") if isinstance(value, dict) else value if isinstance(value, str) else None
        if isinstance(url, str) and not url.startswith("data:"):
            raise ValueError(f"'{key}' must be an inline data: URL; the gateway does not fetch remote media")


class _Extensible(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> _Extensible:
        extra = self.model_extra or {}
        for name in REFUSED_FIELDS:
            if name in extra:
                raise ValueError(f"the field '{name}' is not accepted by this gateway")
        for name in _GATEWAY_FIELDS:
            extra.pop(name, None)
        return self


class ChatMessage(BaseModel):
    """One chat message; unknown fields (``name``, ``tool_calls``, ...) pass through."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(v, list):
            if len(v) > 1024:
                raise ValueError("at most 1024 content parts")
            for part in v:
                _check_media(part)
        return v


class ChatCompletionRequest(_Extensible):
    """``POST /v1/chat/completions`` -- other OpenAI/vLLM fields go through to the replica."""

    model: ModelName
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    user: str | None = Field(default=None, max_length=256)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=512)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Extensible):
    """``POST /v1/completions`` -- ``max_tokens`` defaults to 16, as in OpenAI and vLLM."""

    model: ModelName
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: MaxTokens | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    user: str | None = Field(default=None, max_length=256)

    @field_validator("prompt")
    @classmethod
    def _bounded(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 100_000:
            raise ValueError("prompt lists may hold at most 100000 items")
        return v


class EmbeddingRequest(_Extensible):
    """``POST /v1/embeddings``."""

    model: ModelName
    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    user: str | None = Field(default=None, max_length=256)
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1, le=65_536)

    @field_validator("input")
    @classmethod
    def _bounded(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 100_000:
            raise ValueError("input lists may hold at most 100000 items")
        return v


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "tidal"
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
