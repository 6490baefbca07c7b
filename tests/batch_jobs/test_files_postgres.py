"""Files in PostgreSQL large objects (``TIDAL_FILES_URL``), on the real server: streamed both ways,
the size limit enforced as bytes arrive, and a write visible whole or not at all."""

from __future__ import annotations

import asyncio
import threading
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

from tests.batch_tier import postgres_database, require_postgres
from tidal.batch_jobs.files import FileTooLarge, LocalFileStore, file_ref, file_store_from_settings
from tidal.batch_jobs.files_postgres import PostgresFileStore
from tidal.settings import Settings

pytestmark = [pytest.mark.postgres, pytest.mark.anyio]

MiB = 1 << 20


@pytest.fixture
def url() -> Iterator[str]:
    require_postgres()
    with postgres_database() as u:
        yield u


@pytest.fixture
def files(url: str) -> PostgresFileStore:
    return PostgresFileStore(url, max_bytes=4 * MiB)


def _large_objects(url: str) -> int:
    """Large objects in the database, as another session sees them."""
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        row = conn.execute("SELECT count(*) FROM pg_largeobject_metadata").fetchone()
    assert row is not None
    return int(row[0])


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _lines(n: int) -> list[bytes]:
    return [f'{{"custom_id": "r{i}", "pad": "{"x" * (i % 97)}"}}\n'.encode() for i in range(n)]


async def test_an_upload_streams_in_and_out_and_is_deleted_with_its_object(
    files: PostgresFileStore, url: str
) -> None:
    # Given a 3 MiB upload arriving in 64 KiB pieces (more than one write buffer)
    data = b"".join(_lines(40_000))[: 3 * MiB]
    ref, size = await files.save_stream("acme", "file-a", _pieces(data, 64 * 1024))
    # Then it is stored whole, under the tenant's reference
    assert (ref, size) == (file_ref("acme", "file-a"), len(data)) and files.exists(ref)
    with files.open(ref) as f:
        assert f.read(10) == data[:10]
        assert f.read() == data[10:]
    with files.open(ref) as f:
        assert b"".join(f) == data  # and line by line, as validation reads it
    assert _large_objects(url) == 1
    # When it is deleted, the row and the large object go; a second delete is no error
    files.delete(ref)
    files.delete(ref)
    assert not files.exists(ref) and _large_objects(url) == 0
    with pytest.raises(FileNotFoundError):
        files.open(ref)


def test_generated_lines_are_stored_in_order(files: PostgresFileStore) -> None:
    lines = _lines(30_000)
    ref, size = files.save_lines(
        "acme", "file-out", (ln.decode() if i % 2 else ln for i, ln in enumerate(lines))
    )
    assert size == sum(map(len, lines))
    with files.open(ref) as f:
        assert list(f) == lines


async def test_an_upload_over_the_limit_is_refused_and_leaves_no_object(
    files: PostgresFileStore, url: str
) -> None:
    # Given a 5 MiB upload against a 4 MiB limit, When it arrives
    with pytest.raises(FileTooLarge):
        await files.save_stream("acme", "file-big", _pieces(b"x" * (5 * MiB), MiB))
    # Then nothing of it is kept: no row, no large object (the transaction rolled back)
    assert not files.exists(file_ref("acme", "file-big")) and _large_objects(url) == 0
    # and exactly the limit is accepted
    _, size = await files.save_stream("acme", "file-max", _pieces(b"y" * (4 * MiB), MiB))
    assert size == 4 * MiB


async def test_an_interrupted_upload_leaves_nothing(files: PostgresFileStore, url: str) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"a" * MiB
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await files.save_stream("acme", "file-cut", broken())
    assert not files.exists(file_ref("acme", "file-cut")) and _large_objects(url) == 0

    def lines() -> Iterator[str]:
        yield "one\n"
        raise RuntimeError("the finaliser died")

    with pytest.raises(RuntimeError):
        files.save_lines("acme", "file-gen", lines())
    assert not files.exists(file_ref("acme", "file-gen")) and _large_objects(url) == 0


async def test_a_reader_sees_nothing_of_a_write_until_it_commits(files: PostgresFileStore, url: str) -> None:
    # Given an upload that has sent 2 MiB and then waits for the rest
    ref = file_ref("acme", "file-slow")
    halfway, go_on = asyncio.Event(), asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"a" * MiB
        yield b"b" * MiB
        halfway.set()
        await go_on.wait()
        yield b"c\n"

    upload = asyncio.create_task(files.save_stream("acme", "file-slow", slow()))
    await asyncio.wait_for(halfway.wait(), 30)
    await asyncio.sleep(0.1)  # let the writes the upload has made reach the server
    # When another process (another store, other connections) looks for it
    other = PostgresFileStore(url, max_bytes=4 * MiB)
    seen: dict[str, object] = {}

    def look() -> None:
        seen["exists"] = other.exists(ref)
        try:
            other.open(ref).close()
            seen["open"] = "opened"
        except FileNotFoundError:
            seen["open"] = "not found"
        seen["objects"] = _large_objects(url)

    reader = threading.Thread(target=look)
    reader.start()
    await asyncio.to_thread(reader.join, 30)
    # Then it sees no file and no large object
    assert seen == {"exists": False, "open": "not found", "objects": 0}
    # And once the upload completes, it sees all of it
    go_on.set()
    _, size = await asyncio.wait_for(upload, 30)
    assert size == 2 * MiB + 2 and other.exists(ref)
    with other.open(ref) as f:
        assert f.read() == b"a" * MiB + b"b" * MiB + b"c\n"


def test_a_delete_during_a_read_does_not_cut_it_short(files: PostgresFileStore, url: str) -> None:
    lines = _lines(20_000)
    ref, _ = files.save_lines("acme", "file-r", lines)
    with files.open(ref) as f:
        first = f.readline()
        files.delete(ref)  # another client deletes the file while this one reads it
        rest = f.read()
    assert [first, *rest.splitlines(keepends=True)] == lines
    assert not files.exists(ref) and _large_objects(url) == 0


def test_a_file_streams_through_bounded_memory(files: PostgresFileStore) -> None:
    # 24 MiB written and read back: the process never holds more than a few chunks of it
    files.max_bytes = 64 * MiB
    block = b"z" * (MiB - 1) + b"\n"
    tracemalloc.start()
    try:
        ref, size = asyncio.run(files.save_stream("acme", "file-huge", _repeat(block, 24)))
        with files.open(ref) as f:
            total = sum(len(line) for line in f)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == total == 24 * MiB
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB"


async def _repeat(block: bytes, n: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield block


def test_the_store_is_chosen_by_a_setting(url: str, tmp_path: Path) -> None:
    local = file_store_from_settings(Settings(_env_file=None, data_dir=tmp_path))  # type: ignore[call-arg]
    assert isinstance(local, LocalFileStore) and local.root == tmp_path / "files"
    shared = file_store_from_settings(
        Settings(_env_file=None, data_dir=tmp_path, files_url=url, max_file_bytes=123)  # type: ignore[call-arg]
    )
    assert isinstance(shared, PostgresFileStore) and shared.max_bytes == 123
    with pytest.raises(ValueError, match="files_url"):
        Settings(_env_file=None, files_url="s3://bucket/files")  # type: ignore[call-arg]
