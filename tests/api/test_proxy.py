"""The proxy's SSE scan (only until the first token) and its error reshaping, as tables."""

from __future__ import annotations

import pytest

from api.proxy import _FirstToken, _upstream_error_body

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
EMPTY = b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}\n\n'
EMPTY_TEXT = b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}\n\n'
TEXT = b'data: {"choices":[{"index":0,"text":" once","finish_reason":null}]}\n\n'
TOOL = b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n'
ERROR = b'data: {"error":{"message":"engine died","type":"InternalServerError","code":500}}\n\n'
DONE = b"data: [DONE]\n\n"

CASES = [
    ("role chunk is not a token", [ROLE], [None]),
    ("content is", [ROLE, TOKEN], [None, "token"]),
    ("a token whose text is empty is", [ROLE, EMPTY], [None, "token"]),
    ("completion text is", [TEXT], ["token"]),
    ("empty completion text is", [EMPTY_TEXT], ["token"]),
    ("tool calls are", [TOOL], ["token"]),
    ("error before output", [ROLE, ERROR], [None, "error"]),
    ("end without output", [ROLE, DONE], [None, "done"]),
    ("split across pieces", [TOKEN[:20], TOKEN[20:]], [None, "token"]),
    ("keep-alive comments are skipped", [b": keep-alive\n\n", TOKEN], [None, "token"]),
]


@pytest.mark.parametrize(("case", "pieces", "want"), CASES, ids=[c[0] for c in CASES])
def test_first_token_scan(case: str, pieces: list[bytes], want: list[str | None]) -> None:
    scan = _FirstToken()
    assert [scan.feed(p) for p in pieces] == want


def test_a_stream_without_output_is_held_only_so_long() -> None:
    scan = _FirstToken(limit=3 * len(ROLE))
    assert [scan.feed(p) for p in (ROLE, b": keep-alive\n\n", ROLE, ROLE, ROLE[:10])] == [
        None,
        None,
        None,
        "token",
        "token",
    ]


def test_upstream_errors_are_reshaped_openai_style() -> None:
    vllm = b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}'
    body = _upstream_error_body(404, vllm)["error"]
    assert body == {
        "message": "The model `x` does not exist.",
        "type": "not_found_error",
        "param": "model",
        "code": None,
    }
    plain = _upstream_error_body(503, b"Service Unavailable")["error"]
    assert plain["message"] == "Service Unavailable" and plain["type"] == "service_unavailable_error"
