"""The SSE decoder against the event-stream rules: line ends, multi-line data, comments, fields,
and any split of the bytes into pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from tidal.replicas.wire.sse import Event, SSEDecoder, SSEError


def _decode(*pieces: bytes) -> list[Event]:
    decoder = SSEDecoder()
    return [event for piece in pieces for event in decoder.feed(piece)]


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (b"data: a\n\n", [Event(b"a")]),
        (b"data: a\r\n\r\n", [Event(b"a")]),
        (b"data: a\r\r", [Event(b"a")]),
        (b"data: a\r\n\ndata: b\r\r", [Event(b"a"), Event(b"b")]),
        (b"data: a\ndata: b\n\n", [Event(b"a\nb")]),
        (b"data:a\n\n", [Event(b"a")]),
        (b"data:  two spaces\n\n", [Event(b" two spaces")]),
        (b"data\n\n", [Event(b"")]),
        (b"data:\n\n", [Event(b"")]),
        (b": keep-alive\n\n", []),
        (b": comment\ndata: x\n\n", [Event(b"x")]),
        (b"event: ping\ndata: x\n\n", [Event(b"x", b"ping")]),
        (b"event: ping\n\ndata: x\n\n", [Event(b"x")]),  # the type resets at the blank line
        (b"\n\ndata: x\n\n\ndata: y\n\n", [Event(b"x"), Event(b"y")]),
        (b"id: 7\ndata: x\n\ndata: y\n\n", [Event(b"x", id=b"7"), Event(b"y", id=b"7")]),
        (b"id: a\0b\ndata: x\n\n", [Event(b"x")]),
        (b"retry: 3000\ndata: x\n\n", [Event(b"x", retry=3000)]),
        (b"retry: 3s\ndata: x\n\n", [Event(b"x")]),
        (b"unknown: 1\ndata: x\n\n", [Event(b"x")]),
        (b"\xef\xbb\xbfdata: x\n\n", [Event(b"x")]),
        (b"data: x\n", []),  # not dispatched until its blank line
        (b"data: x", []),
        (b"data: [DONE]\n\n", [Event(b"[DONE]")]),
    ],
)
def test_decodes_the_spec_cases(stream: bytes, expected: list[Event]) -> None:
    assert _decode(stream) == expected
    assert _decode(*(stream[i : i + 1] for i in range(len(stream)))) == expected


def test_a_crlf_split_between_pieces_is_one_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n\r") == [Event(b"a")]
    assert decoder.feed(b"\ndata: b\r\n\r\n") == [Event(b"b")]


def test_an_event_is_out_as_soon_as_its_blank_line_arrives() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: 1\r\n\r\n") == [Event(b"1")]
    assert decoder.feed(b"data: 2\r\r") == [Event(b"2")]  # a lone CR ends the line at once


def test_a_line_that_never_ends_is_refused() -> None:
    decoder = SSEDecoder(max_line=64)
    decoder.feed(b"data: " + b"x" * 50)
    with pytest.raises(SSEError):
        decoder.feed(b"x" * 50)


_text = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)
_events = st.lists(
    st.tuples(
        st.lists(_text, min_size=1, max_size=3),
        st.one_of(st.none(), _text.filter(lambda b: b and not b.startswith(b" "))),
    ),
    max_size=6,
)


@given(_events, st.sampled_from([b"\n", b"\r\n", b"\r"]), st.lists(st.integers(0, 400), max_size=8))
def test_any_stream_split_anywhere_decodes_to_its_events(
    events: list[tuple[list[bytes], bytes | None]], eol: bytes, cuts: list[int]
) -> None:
    wire = b""
    for data_lines, kind in events:
        wire += b": a comment" + eol
        if kind is not None:
            wire += b"event: " + kind + eol
        wire += b"".join(b"data: " + line + eol for line in data_lines) + eol
    bounds = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    pieces = [wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    expected = [Event(b"\n".join(lines), kind or b"message") for lines, kind in events]
    assert _decode(*pieces) == expected
