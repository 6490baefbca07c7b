"""The proxy's watch over the SSE it passes on (first token, errors, tokens per choice) and its error
reshaping, as tables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tidal.api.proxy import _upstream_error_body, _Watch
from tidal.clock import ManualClock

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
    ("CRLF framing", [ROLE.replace(b"\n", b"\r\n"), TOKEN.replace(b"\n", b"\r\n")], [None, "token"]),
    ("CR framing", [ROLE.replace(b"\n", b"\r"), TOKEN.replace(b"\n", b"\r")], [None, "token"]),
    ("CRLF split between pieces", [TOKEN.replace(b"\n", b"\r\n")[:-3], b"\n\r\n"], [None, "token"]),
]


@pytest.mark.parametrize(("case", "pieces", "want"), CASES, ids=[c[0] for c in CASES])
def test_first_token_scan(case: str, pieces: list[bytes], want: list[str | None]) -> None:
    scan = _Watch(ManualClock())
    assert [scan.feed(p) for p in pieces] == want


def test_a_stream_without_output_is_held_only_so_long() -> None:
    scan = _Watch(ManualClock(), limit=3 * len(ROLE))
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


def _chunk(index: int, text: str) -> bytes:
    return b'data: {"choices":[{"index":%d,"delta":{"content":"%s"}}]}\n\n' % (index, text.encode())


def test_tpot_counts_tokens_per_choice_not_data_lines() -> None:
    """Two choices of 5 tokens each, 10 ms apart per token: TPOT is 10 ms, whatever the framing
    (one event per line, or several events and comments in one piece)."""
    clock = ManualClock()
    watch = _Watch(clock, choices=2)
    watch.feed(ROLE)
    for _ in range(5):
        watch.feed(_chunk(0, "a") + b": data: not an event\n\n" + _chunk(1, "b"))
        clock.advance(0.01)
    watch.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":10}}\n\n' + DONE)
    assert watch.tokens_per_choice() == 5
    assert watch.tpot() == pytest.approx(0.01)


def test_without_a_usage_chunk_tokens_are_the_longest_choice_s_output_events() -> None:
    clock = ManualClock()
    watch = _Watch(clock, choices=2)
    for _ in range(6):
        watch.feed(_chunk(0, "a"))
        clock.advance(0.02)
    watch.feed(_chunk(1, "b") + DONE)
    assert watch.tokens_per_choice() == 6
    assert watch.tpot() is not None


USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"length"}]}\n\n'


@pytest.mark.parametrize(
    ("case", "tail", "tokens"),
    [
        ("usage chunk after the last token", USAGE % 6 + DONE, 6),
        ("no usage chunk: the events with output", FINISH + DONE, 6),
        ("an error ends the stream", ERROR + DONE, 5),
        ("usage and [DONE] in pieces of their own", USAGE % 6, 6),
    ],
)
def test_one_choice_counts_its_events_and_reads_only_the_last(case: str, tail: bytes, tokens: int) -> None:
    """One choice: 5 tokens 10 ms apart, then the tail arrives 50 ms later. The tokens are the
    usage count when there is one, else the output events; a tail without output does not
    stretch the last token's time."""
    clock = ManualClock()
    watch = _Watch(clock)
    assert watch.feed(ROLE) is None
    for i in range(5):
        assert watch.feed(TOKEN) == "token"
        if i < 4:
            clock.advance(0.01)
    clock.advance(0.05)
    watch.feed(tail)
    assert watch.tokens_per_choice() == tokens
    last = 0.05 if tail.startswith(FINISH) else 0.0  # the finish chunk is a (last, empty) token
    assert watch.t_last - watch.t_first == pytest.approx(0.04 + last)
    assert watch.tokens_per_choice() == tokens  # asking twice changes nothing


def _split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i : i + n] for i in range(0, len(data), n)]


STREAM = [ROLE] + [TOKEN] * 8 + [FINISH, USAGE % 9, DONE]
LAYOUTS = {
    "one event per piece": STREAM,
    "several events per piece": [ROLE, TOKEN, b"".join(STREAM[2:6]), b"".join(STREAM[6:])],
    "CRLF framing": [e.replace(b"\n", b"\r\n") for e in STREAM],
    "comments between tokens": [x for e in STREAM for x in (e, b": keep-alive\n\n")],
    "split mid-event": _split_every(b"".join(STREAM), 37),
    "a piece pending when a whole event arrives": [ROLE, TOKEN, TOKEN[:10], TOKEN[10:], *STREAM[3:]],
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_the_per_token_fast_path_counts_as_the_decoder_does(layout: str) -> None:
    """Past the first token, whole single-line events skip the decoder; any framing or split gives
    the same count, end and times as the decoder alone."""

    def watched(fast: bool) -> tuple[int, bool, float]:
        clock = ManualClock()
        watch = _Watch(clock)
        for piece in LAYOUTS[layout]:
            watch.feed(piece)
            if not fast:
                watch._passing = False
            clock.advance(0.01)
        assert watch.t_first is not None
        return watch.tokens_per_choice(), watch.done, watch.t_last - watch.t_first

    assert watched(fast=True) == watched(fast=False)
    assert watched(fast=True)[:2] == (9, True)


# Events a replica (or something between it and the gateway) may send after the first token
_EVENTS = st.sampled_from(
    [
        TOKEN,
        TOKEN,
        TOKEN.replace(b"\n", b"\r\n"),
        b": keep-alive\n\n",
        b"data: " + TOKEN[6:-2] + b"\ndata: \n\n",  # a two-line event
        b"id: 7\n" + TOKEN,
        b"data:" + TOKEN[6:],  # no space after the colon
        b"\n",  # a stray blank line
        FINISH,
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    events=st.lists(_EVENTS, max_size=12),
    tail=st.sampled_from([USAGE % 9 + DONE, DONE, b""]),
    joins=st.lists(st.booleans(), min_size=16, max_size=16),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=3),
)
def test_the_fast_path_counts_any_stream_as_the_decoder_does(
    events: list[bytes], tail: bytes, joins: list[bool], cuts: list[int]
) -> None:
    """Whatever the events and however the bytes come in pieces (several events in one, an event
    across two), counting past the first token gives what the decoder alone gives."""
    pieces = [ROLE, TOKEN]
    for i, event in enumerate([*events, tail]):
        if joins[i] and len(pieces) > 2:
            pieces[-1] += event  # arrived with the one before
        else:
            pieces.append(event)
    for cut in cuts:  # and a few pieces cut anywhere
        i = 2 + cut % max(1, len(pieces) - 2)
        if i < len(pieces) and len(pieces[i]) > 1:
            at = 1 + cut % (len(pieces[i]) - 1)
            pieces[i : i + 1] = [pieces[i][:at], pieces[i][at:]]

    def watched(fast: bool) -> tuple[int, bool, float]:
        clock = ManualClock()
        watch = _Watch(clock)
        for piece in pieces:
            watch.feed(piece)
            if not fast:
                watch._passing = False
            clock.advance(0.01)
        assert watch.t_first is not None
        return watch.tokens_per_choice(), watch.done, round(watch.t_last - watch.t_first, 6)

    assert watched(fast=True) == watched(fast=False)


def test_the_watch_knows_when_the_bytes_passed_on_end_inside_an_event() -> None:
    """A stream cut there gets a blank line before its error event, so both parse."""
    watch = _Watch(ManualClock())
    watch.feed(ROLE)
    watch.feed(TOKEN)
    assert not watch.mid_event
    watch.feed(TOKEN[:30])
    assert watch.mid_event
    watch.feed(TOKEN[30:])
    assert not watch.mid_event
