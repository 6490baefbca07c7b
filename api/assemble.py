"""A non-streaming answer assembled from the replica's stream.

The gateway asks the replica to stream every chat and text completion, so that a non-streaming
request is measured like a streaming one (time to first token, time per output token, a retry
until the first token, the replica's load) and then answers with the JSON body the client asked
for: ``chat.completion`` or ``text_completion``, as vLLM and OpenAI shape it.

Requests whose answer carries what the stream does not (vLLM's ``prompt_logprobs``, ``echo``)
are not assembled: :func:`assemblable` says which are.

Example::

    answer = Assembler(chat=True)
    for chunk in chunks:  # each a parsed ``data:`` event
        answer.add(chunk)
    body = answer.result()
"""

from __future__ import annotations

from typing import Any

__all__ = ["Assembler", "assemblable", "streamed_body"]

_PASSTHROUGH = ("prompt_logprobs", "echo")


def assemblable(body: dict[str, Any]) -> bool:
    """Whether a non-streaming request can be served from the replica's stream."""
    return not any(body.get(key) for key in _PASSTHROUGH)


def streamed_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as sent upstream: streamed, with the usage chunk at the end."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


class _Choice:
    __slots__ = ("content", "finish_reason", "logprobs", "reasoning", "role", "stop_reason", "tool_calls")

    def __init__(self) -> None:
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.logprobs: dict[str, list[Any]] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None


class Assembler:
    """Folds ``chat.completion.chunk`` (``chat=True``) or streamed ``text_completion`` objects
    into one answer."""

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self.head: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, _Choice] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
            if "system_fingerprint" in chunk:
                self.head["system_fingerprint"] = chunk["system_fingerprint"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for raw in chunk.get("choices") or ():
            if not isinstance(raw, dict):
                continue
            index = raw.get("index", 0)
            choice = self.choices.get(index)
            if choice is None:
                choice = self.choices[index] = _Choice()
            if raw.get("finish_reason") is not None:
                choice.finish_reason = raw["finish_reason"]
            if raw.get("stop_reason") is not None:
                choice.stop_reason = raw["stop_reason"]
            self._logprobs(choice, raw.get("logprobs"))
            if self.chat:
                self._delta(choice, raw.get("delta"))
            elif isinstance(raw.get("text"), str):
                choice.content.append(raw["text"])

    @staticmethod
    def _logprobs(choice: _Choice, logprobs: Any) -> None:
        if not isinstance(logprobs, dict):
            return
        if choice.logprobs is None:
            choice.logprobs = {}
        for key, value in logprobs.items():
            if isinstance(value, list):
                choice.logprobs.setdefault(key, []).extend(value)

    @staticmethod
    def _delta(choice: _Choice, delta: Any) -> None:
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("role"), str):
            choice.role = delta["role"]
        if isinstance(delta.get("content"), str):
            choice.content.append(delta["content"])
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str):
            choice.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            into = choice.tool_calls.setdefault(
                call.get("index", len(choice.tool_calls)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                into["id"] = call["id"]
            if call.get("type"):
                into["type"] = call["type"]
            function = call.get("function")
            if isinstance(function, dict):
                if function.get("name"):
                    into["function"]["name"] += function["name"]
                if isinstance(function.get("arguments"), str):
                    into["function"]["arguments"] += function["arguments"]

    def result(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            out: dict[str, Any] = {"index": index}
            if self.chat:
                message: dict[str, Any] = {"role": c.role, "content": "".join(c.content)}
                if c.reasoning:
                    message["reasoning_content"] = "".join(c.reasoning)
                if c.tool_calls:
                    message["tool_calls"] = [c.tool_calls[i] for i in sorted(c.tool_calls)]
                    if not c.content:
                        message["content"] = None
                out["message"] = message
            else:
                out["text"] = "".join(c.content)
            out["logprobs"] = c.logprobs
            out["finish_reason"] = c.finish_reason
            out["stop_reason"] = c.stop_reason
            choices.append(out)
        body: dict[str, Any] = {
            "id": self.head.get("id", ""),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.head.get("created", 0),
            "model": self.head.get("model", ""),
            "choices": choices,
            "usage": self.usage,
        }
        if "system_fingerprint" in self.head:
            body["system_fingerprint"] = self.head["system_fingerprint"]
        return body
