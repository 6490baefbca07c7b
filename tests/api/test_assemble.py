"""Non-streaming answers assembled from a replica's stream, as tables of chunks."""

from __future__ import annotations

from typing import Any

from tidal.api.assemble import Assembler, assemblable, streamed_body


def _chat(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }


def test_chat_choices_content_and_usage() -> None:
    a = Assembler(chat=True)
    for chunk in (
        _chat(0, {"role": "assistant", "content": ""}),
        _chat(1, {"role": "assistant", "content": ""}),
        _chat(0, {"content": "Hel"}),
        _chat(1, {"content": "Bye"}),
        _chat(0, {"content": "lo"}, "stop"),
        _chat(1, {}, "length"),
        {
            "id": "chatcmpl-1",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        },
    ):
        a.add(chunk)
    body = a.result()
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1" and body["created"] == 7
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello", "Bye"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"]["total_tokens"] == 7


def test_tool_call_fragments_are_merged_by_index() -> None:
    a = Assembler(chat=True)
    a.add(
        _chat(
            0,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get", "arguments": ""},
                    }
                ],
            },
        )
    )
    a.add(_chat(0, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}))
    a.add(_chat(0, {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, "tool_calls"))
    message = a.result()["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}
    ]


def test_text_completion_with_logprobs() -> None:
    a = Assembler(chat=False)
    for text, lp in (("a", -0.1), ("b", -0.2)):
        a.add(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": {"tokens": [text], "token_logprobs": [lp]},
                        "finish_reason": None,
                    }
                ],
            }
        )
    choice = a.result()["choices"][0]
    assert choice["text"] == "ab"
    assert choice["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2]}
    assert a.result()["object"] == "text_completion"


def test_what_the_stream_cannot_carry_is_not_assembled() -> None:
    assert assemblable({"prompt": "x"})
    assert not assemblable({"prompt": "x", "echo": True})
    assert not assemblable({"prompt": "x", "prompt_logprobs": 1})
    assert streamed_body({"prompt": "x", "stream": False})["stream_options"] == {"include_usage": True}
