"""Files and Batches through the official `openai` SDK: shapes, tenancy, bad input.

The gateway runs in-process (the SDK's HTTP client is the app's TestClient); publishing goes to
kombu's in-memory broker because nothing consumes here -- execution has its own tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tests.batch_tier import chat_lines, openai_client
from tidal.api.app import create_app
from tidal.api.auth import KeyStore, Principal
from tidal.fleet import parse_fleet
from tidal.settings import Settings

MAX_BYTES = 64 * 1024


@pytest.fixture
def tc(tmp_path: Path) -> Iterator[TestClient]:
    fleet = parse_fleet(
        {
            "models": [{"name": "tiny"}, {"name": "tiny-embed", "embedding": True}],
            "adapters": [
                {"name": "tiny-lora", "path": "/x", "base_model": "tiny"},
                {"name": "embed-lora", "path": "/y", "base_model": "tiny-embed"},
            ],
            "pools": {
                "batch": {
                    "kind": "batch",
                    "model": "tiny",
                    "replicas": [{"name": "r", "url": "http://127.0.0.1:9"}],
                }
            },
        }
    )
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        data_dir=tmp_path,
        broker_url="memory://",
        max_file_bytes=MAX_BYTES,
        max_batch_lines=100,
    )
    keys = KeyStore()
    keys.add_key("key-a", Principal("tenant-a", frozenset({"*"})))
    keys.add_key("key-b", Principal("tenant-b", frozenset({"*"})))
    keys.add_key("key-admin", Principal("ops", frozenset({"*"}), admin=True))
    with TestClient(create_app(fleet, settings, keys=keys)) as client:
        yield client


@pytest.fixture
def a(tc: TestClient) -> openai.OpenAI:
    return openai_client(tc, "key-a")  # type: ignore[no-any-return]


@pytest.fixture
def b(tc: TestClient) -> openai.OpenAI:
    return openai_client(tc, "key-b")  # type: ignore[no-any-return]


def _line(**over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    }
    line.update(over)
    return line


def _jsonl(*lines: Any) -> bytes:
    return "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines).encode()


def _create(client: openai.OpenAI, data: bytes, **kw: Any) -> Any:
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint=kw.pop("endpoint", "/v1/chat/completions"), completion_window="24h", **kw
    )


def test_upload_retrieve_content_list_delete(a: openai.OpenAI) -> None:
    data = chat_lines(3)
    f = a.files.create(file=("../../etc/passwd", data), purpose="batch")
    assert f.object == "file" and f.bytes == len(data) and f.purpose == "batch"
    assert f.filename == "passwd"  # a display name only; never a path
    assert a.files.retrieve(f.id).id == f.id
    assert a.files.content(f.id).read() == data
    assert [x.id for x in a.files.list().data] == [f.id]
    assert a.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(f.id)


def test_a_batch_has_the_openai_shape_and_lists_newest_first(a: openai.OpenAI) -> None:
    first = _create(a, chat_lines(3), metadata={"priority": "9", "lane": "spot"})
    assert first.object == "batch" and first.status == "in_progress" and first.model == "tiny"
    assert first.request_counts.total == 3 and first.request_counts.completed == 0
    assert first.metadata == {"priority": "9", "lane": "spot"}
    assert first.expires_at == first.created_at + 24 * 3600
    ids = [_create(a, chat_lines(1)).id for _ in range(4)] + [first.id]
    assert a.batches.retrieve(first.id).id == first.id
    page = a.batches.list(limit=2)
    assert [x.id for x in page.data] == ids[3::-1][:2] and page.has_more
    rest = a.batches.list(limit=10, after=page.data[-1].id)
    assert [x.id for x in rest.data] == [ids[1], ids[0], first.id] and not rest.has_more
    # The SDK's auto-pagination walks the cursor
    assert len(list(a.batches.list(limit=2))) == 5


def test_tenants_see_only_their_own_files_and_batches(a: openai.OpenAI, b: openai.OpenAI) -> None:
    batch = _create(a, chat_lines(2))
    fid = batch.input_file_id
    # Another tenant's ids are a 404, never a 403: nothing says they exist
    for call in (
        lambda: b.files.retrieve(fid),
        lambda: b.files.content(fid),
        lambda: b.files.delete(fid),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.batches.list().data == [] and b.files.list().data == []
    assert a.batches.retrieve(batch.id).id == batch.id


@pytest.mark.parametrize(
    ("lines", "errors"),
    [
        pytest.param(
            [_line(custom_id="a"), "{not json", _line(custom_id="c")],
            [(2, "invalid_json_line")],
            id="malformed JSON",
        ),
        pytest.param(
            [_line(custom_id="a"), _line(custom_id="b"), _line(custom_id="a"), _line(custom_id="b")],
            [(3, "duplicate_custom_id"), (4, "duplicate_custom_id")],
            id="duplicate custom_id",
        ),
        pytest.param(
            [_line(custom_id="a", url="/v1/embeddings"), _line(custom_id="b", method="GET")],
            [(1, "mismatched_endpoint"), (2, "invalid_method")],
            id="wrong url and method",
        ),
        pytest.param(
            [_line(custom_id="a", body=[]), {"method": "POST"}, "[1, 2]"],
            [(1, "invalid_body"), (2, "missing_required_parameter"), (3, "invalid_json_line")],
            id="body not an object, no custom_id, not an object",
        ),
        pytest.param(
            [
                _line(custom_id="a", body={"model": "nope", "messages": []}),
                _line(custom_id="b", body={"model": "tiny-lora", "messages": []}),
                _line(custom_id="c", body={"model": "tiny", "messages": [], "stream": True}),
                _line(custom_id="d", body={"model": "tiny"}),
            ],
            [(1, "model_not_found"), (3, "invalid_value"), (4, "missing_required_parameter")],
            id="model not served, streaming, no messages",
        ),
        pytest.param(
            [
                _line(custom_id="a", body={"model": "tiny-embed", "messages": []}),
                _line(custom_id="b", body={"model": "embed-lora", "messages": []}),
                _line(custom_id="c", body={"model": "tiny-lora", "messages": []}),
            ],
            [(1, "model_not_supported"), (2, "model_not_supported")],
            id="an embedding model or its adapter in a chat batch",
        ),
    ],
)
def test_bad_lines_fail_the_batch_naming_every_line(
    a: openai.OpenAI, lines: list[Any], errors: list[tuple[int, str]]
) -> None:
    batch = _create(a, _jsonl(*lines))
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.code) for e in batch.errors.data] == errors
    assert all(f"Line {e.line}" in e.message for e in batch.errors.data)
    assert batch.request_counts.total == 0
    assert a.batches.retrieve(batch.id).status == "failed"


def test_an_embeddings_batch_takes_embedding_models_only(a: openai.OpenAI) -> None:
    def line(cid: str, model: str) -> dict[str, Any]:
        return {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": model, "input": "x"},
        }

    refused = _create(a, _jsonl(line("a", "tiny-embed"), line("b", "tiny")), endpoint="/v1/embeddings")
    assert refused.status == "failed"
    [error] = refused.errors.data
    assert (error.line, error.code) == (2, "model_not_supported")
    assert "/v1/embeddings" in error.message and "not an embedding model" in error.message
    ok = _create(a, _jsonl(line("a", "tiny-embed"), line("b", "embed-lora")), endpoint="/v1/embeddings")
    assert ok.status != "failed" and ok.request_counts.total == 2


def test_too_many_lines_fail_the_batch(a: openai.OpenAI) -> None:
    batch = _create(a, chat_lines(101))
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [(101, "too_many_requests")]


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"endpoint": "/v1/responses"}, 400, "endpoint"),
        ({"completion_window": "1h"}, 400, "completion_window"),
        ({"metadata": {"priority": "10"}}, 400, "metadata.priority"),
        ({"metadata": {"priority": "high"}}, 400, "metadata.priority"),
        ({"metadata": {"lane": "fast"}}, 400, "metadata.lane"),
        ({"metadata": {"deadline": "1"}}, 400, "metadata.deadline"),
        ({"metadata": {"pool": "batch"}}, 403, "metadata.pool"),
        ({"input_file_id": "file-doesnotexist"}, 404, "input_file_id"),
    ],
)
def test_bad_batch_requests_are_refused_and_nothing_is_created(
    a: openai.OpenAI, kwargs: dict[str, Any], status: int, param: str
) -> None:
    f = a.files.create(file=("in.jsonl", chat_lines(2)), purpose="batch")
    args: dict[str, Any] = {
        "input_file_id": f.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    args.update(kwargs)
    with pytest.raises(openai.APIStatusError) as exc:
        a.batches.create(**args)
    assert exc.value.status_code == status
    body = exc.value.body
    assert isinstance(body, dict) and body["param"] == param and body["message"]
    assert a.batches.list().data == []


def test_wrong_purpose_is_refused(a: openai.OpenAI) -> None:
    data = a.files.create(file=("d.jsonl", b'{"text": "x"}\n'), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        a.batches.create(input_file_id=data.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose must be one of"):
        a.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert a.batches.list().data == []


def test_upload_limits(a: openai.OpenAI, tc: TestClient, tmp_path: Path) -> None:
    # Over the size limit: 413 and nothing kept, whether or not the size was announced
    with pytest.raises(openai.APIStatusError) as exc:
        a.files.create(file=("big.jsonl", b"x" * (MAX_BYTES + 1)), purpose="batch")
    assert exc.value.status_code == 413

    def chunked() -> Iterator[bytes]:
        boundary = b"--XyZ"
        yield boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="b.jsonl"\r\n\r\n'
        for _ in range(MAX_BYTES // 1000 + 100):
            yield b"y" * 1000
        yield b"\r\n" + boundary + b"--\r\n"

    r = tc.post(
        "/v1/files",
        content=chunked(),
        headers={"Authorization": "Bearer key-a", "Content-Type": "multipart/form-data; boundary=XyZ"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    # Empty: 400
    with pytest.raises(openai.BadRequestError, match="empty"):
        a.files.create(file=("e.jsonl", b""), purpose="batch")
    assert a.files.list().data == []
    assert not [p for p in (tmp_path / "files").rglob("*") if p.is_file()]


def test_cancel_a_finished_batch_is_a_conflict(a: openai.OpenAI) -> None:
    batch = _create(a, _jsonl("{oops"))
    with pytest.raises(openai.ConflictError):
        a.batches.cancel(batch.id)
    live = _create(a, chat_lines(2))
    assert a.batches.cancel(live.id).status == "cancelling"


def test_no_key_no_batches(tc: TestClient) -> None:
    r = tc.get("/v1/batches")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
