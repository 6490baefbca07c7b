"""Hypothesis on what users upload: batch input lines and job datasets. Whatever the bytes, the
parsers answer with a report naming the offending lines, never an exception (an exception here
was a 500 at batch creation: a line nested a hundred thousand arrays deep)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, BinaryIO, Literal

from hypothesis import HealthCheck, given, settings, strategies as st

from tidal.batch_jobs.validation import iter_valid_lines, validate_batch_file

ENDPOINT = "/v1/chat/completions"
MODELS = {"tiny"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
# Lines that are nearly right: the fields a line has, each sometimes wrong.
near_lines = st.fixed_dictionaries(
    {},
    optional={
        "custom_id": st.text(max_size=600) | json_values,
        "method": st.sampled_from(["POST", "GET", "post"]) | json_values,
        "url": st.sampled_from([ENDPOINT, "/v1/completions", "http://10.0.0.1/v1/chat/completions"]),
        "body": st.fixed_dictionaries(
            {},
            optional={
                "model": st.sampled_from(["tiny", "other"]) | json_values,
                "messages": st.just([{"role": "user", "content": "hi"}]) | json_values,
                "stream": st.booleans(),
            },
        )
        | json_values,
    },
)
raw_lines = st.one_of(
    near_lines.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200).filter(lambda b: b"\n" not in b and b"\r" not in b),
    st.integers(min_value=1, max_value=200_000).map(lambda n: b"[" * n + b"]" * n),
    st.just(b'{"custom_id": "a", "body": ' + b"{" * 50_000 + b"}"),
)


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def open(self, mode: Literal["rb"] = "rb") -> BinaryIO:
        return io.BytesIO(self.data)


@given(lines=st.lists(raw_lines, max_size=12))
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_batch_file_gets_a_report_naming_every_bad_line(lines: list[bytes]) -> None:
    source = _Bytes(b"\n".join(lines) + b"\n")
    report = validate_batch_file(source, endpoint=ENDPOINT, models=MODELS, max_lines=1000)
    valid = list(iter_valid_lines(source, endpoint=ENDPOINT, models=MODELS))
    flagged = {e.line for e in report.errors}
    for no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        # Every line is either accepted or named (a duplicate custom_id is both: named later).
        assert no in flagged or any(p.line_no == no for p in valid), (no, raw[:80])
    for p in valid:
        assert p.body.get("model") == "tiny" and not p.body.get("stream")


def test_a_line_nested_too_deep_is_an_invalid_line_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    good = {"custom_id": "ok", "method": "POST", "url": ENDPOINT, "body": {"model": "tiny", "messages": []}}
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000 + b"\n" + json.dumps(good).encode() + b"\n")
    report = validate_batch_file(path, endpoint=ENDPOINT, models=MODELS, max_lines=10)
    assert [(e.line, e.code) for e in report.errors] == [(1, "invalid_json_line")]
    assert [p.custom_id for p in iter_valid_lines(path, endpoint=ENDPOINT, models=MODELS)] == ["ok"]


@given(lines=st.lists(raw_lines, max_size=8))
@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_job_dataset_is_read_or_refused_as_a_bad_request(lines: list[bytes]) -> None:
    from tidal.batch_jobs.errors import InvalidRequest
    from tidal.batch_jobs.jobs.base import read_dataset

    source: Any = _Bytes(b"\n".join(lines) + b"\n")
    try:
        items = list(read_dataset(source, required=("prompt",), max_items=100))
    except InvalidRequest as exc:
        assert "bad dataset" in str(exc)
        return
    assert items and all(isinstance(obj["prompt"], str) for _, obj in items)
