"""File bytes in PostgreSQL large objects, so that gateways and workers on different hosts share
batch inputs and outputs through the database instead of a disk (``TIDAL_FILES_URL``).

Each file is one large object, streamed in and out in chunks (never whole in memory); the table
``tidal_file_blobs`` maps a store reference to the object's oid. An upload creates the object,
writes it and inserts its row in one transaction: until that commits nobody sees either, and a
refused or interrupted upload (over the size limit, client gone, process killed) leaves nothing.
A read opens the object read-only in a REPEATABLE READ transaction, so it sees the file as of its
start and a concurrent delete does not cut it short. Deleting removes the row and the object.

Gateways and workers must connect as the same role (or one granted on the others' large
objects): a large object belongs to the role that created it. ``vacuumlo`` keeps these objects
(the table references them by an ``oid`` column).

Example::

    files = PostgresFileStore("postgresql://tidal@db:5432/tidal", max_bytes=200 << 20)
    ref, size = await files.save_stream("acme", "file-abc", chunks)
    with files.open(ref) as f:
        for line in f: ...
"""

from __future__ import annotations

import io
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any, BinaryIO

import psycopg
from psycopg import IsolationLevel

from tidal.batch_jobs.files import FileTooLarge, file_ref

__all__ = ["PostgresFileStore"]

# lo_open modes, from PostgreSQL's libpq/libpq-fs.h.
_INV_WRITE = 0x20000
_INV_READ = 0x40000
# Bytes per lowrite/loread round trip: large enough that the round trips cost little, small
# enough that a multi-gigabyte file streams through a bounded buffer.
_CHUNK = 1 << 20
_SCHEMA_LOCK = 0x7469_6461_6C66  # an advisory-lock key of our own ("tidalf"), for CREATE TABLE races
_SCHEMA = """CREATE TABLE IF NOT EXISTS tidal_file_blobs (
    ref text PRIMARY KEY,
    lo oid NOT NULL UNIQUE,
    bytes bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)"""

_URL_SCHEME = re.compile(r"^postgres(?:ql)?(?:\+[a-z0-9_]+)?://")


def _libpq_url(url: str) -> str:
    """libpq's URL for a settings URL (``postgresql+psycopg://`` is SQLAlchemy's spelling)."""
    if not _URL_SCHEME.match(url):
        raise ValueError("a PostgreSQL file store needs a postgresql:// URL")
    return _URL_SCHEME.sub("postgresql://", url, count=1)


class _Buffer:
    """Collects small writes (one output line each) into chunk-sized ones."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.held = 0

    def add(self, data: bytes) -> bytes | None:
        self.parts.append(data)
        self.held += len(data)
        return self.take() if self.held >= _CHUNK else None

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts, self.held = [], 0
        return out


class _LargeObjectReader(io.RawIOBase):
    """A read-only descriptor on one large object; closing it ends its transaction."""

    def __init__(self, conn: psycopg.Connection[Any], fd: int) -> None:
        self._conn = conn
        self._fd = fd

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        row = self._conn.execute(
            "SELECT loread(%s::int4, %s::int4)", (self._fd, min(len(view), _CHUNK)), binary=True
        ).fetchone()
        data: bytes = row[0] if row else b""
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self._conn.close()  # a read-only transaction: closing ends it, nothing to keep
            finally:
                super().close()


class PostgresFileStore:
    """Files as PostgreSQL large objects (see the module's docstring)."""

    def __init__(self, url: str, *, max_bytes: int) -> None:
        self._conninfo = _libpq_url(url)
        self.max_bytes = max_bytes
        # Like the store's tables: created at start, so a bad URL is an error there, not at the
        # first upload. Processes starting together take turns through an advisory lock.
        with self._connect() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            conn.execute(_SCHEMA)

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self._conninfo)

    async def save_stream(self, tenant: str, file_id: str, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        ref = file_ref(tenant, file_id)
        size = 0
        buffer = _Buffer()
        # The connection's context commits on a clean exit and rolls back on any exception (the
        # size limit, a cancelled request): the object and its row then never existed.
        async with await psycopg.AsyncConnection.connect(self._conninfo) as conn:
            cur = await conn.execute("SELECT lo_create(0)")
            lo = _one(await cur.fetchone())
            cur = await conn.execute("SELECT lo_open(%s::oid, %s::int4)", (lo, _INV_WRITE))
            fd = _one(await cur.fetchone())
            async for piece in chunks:
                size += len(piece)
                if size > self.max_bytes:
                    raise FileTooLarge(self.max_bytes)
                if (full := buffer.add(piece)) is not None:
                    await conn.execute("SELECT lowrite(%s::int4, %b)", (fd, full))
            if buffer.held:
                await conn.execute("SELECT lowrite(%s::int4, %b)", (fd, buffer.take()))
            await conn.execute("SELECT lo_close(%s::int4)", (fd,))
            await conn.execute(
                "INSERT INTO tidal_file_blobs (ref, lo, bytes) VALUES (%s, %s::oid, %s)", (ref, lo, size)
            )
        return ref, size

    def save_lines(self, tenant: str, file_id: str, lines: Iterable[bytes | str]) -> tuple[str, int]:
        ref = file_ref(tenant, file_id)
        size = 0
        buffer = _Buffer()
        with self._connect() as conn:
            lo = _one(conn.execute("SELECT lo_create(0)").fetchone())
            fd = _one(conn.execute("SELECT lo_open(%s::oid, %s::int4)", (lo, _INV_WRITE)).fetchone())
            for line in lines:
                data = line.encode() if isinstance(line, str) else line
                size += len(data)
                if (full := buffer.add(data)) is not None:
                    conn.execute("SELECT lowrite(%s::int4, %b)", (fd, full))
            if buffer.held:
                conn.execute("SELECT lowrite(%s::int4, %b)", (fd, buffer.take()))
            conn.execute("SELECT lo_close(%s::int4)", (fd,))
            conn.execute(
                "INSERT INTO tidal_file_blobs (ref, lo, bytes) VALUES (%s, %s::oid, %s)", (ref, lo, size)
            )
        return ref, size

    def open(self, ref: str) -> BinaryIO:
        conn = self._connect()
        try:
            # One snapshot for the lookup and every read after it.
            conn.isolation_level = IsolationLevel.REPEATABLE_READ
            row = conn.execute("SELECT lo FROM tidal_file_blobs WHERE ref = %s", (ref,)).fetchone()
            if row is None:
                raise FileNotFoundError(f"no stored file {ref!r}")
            fd = _one(conn.execute("SELECT lo_open(%s::oid, %s::int4)", (row[0], _INV_READ)).fetchone())
        except BaseException:
            conn.close()
            raise
        return io.BufferedReader(_LargeObjectReader(conn, fd), buffer_size=_CHUNK)

    def exists(self, ref: str) -> bool:
        with self._connect() as conn:
            return (
                conn.execute("SELECT 1 FROM tidal_file_blobs WHERE ref = %s", (ref,)).fetchone() is not None
            )

    def delete(self, ref: str) -> None:
        with self._connect() as conn:
            row = conn.execute("DELETE FROM tidal_file_blobs WHERE ref = %s RETURNING lo", (ref,)).fetchone()
            if row is not None:
                conn.execute("SELECT lo_unlink(%s::oid)", (row[0],))


def _one(row: tuple[Any, ...] | None) -> int:
    assert row is not None  # a SELECT of one function call returns one row
    return int(row[0])
