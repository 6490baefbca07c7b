"""Where file bytes live: uploads (batch input, job datasets) and generated outputs.

A :class:`FileStore` keeps each file under a reference built from the tenant's hash and a random
file id, never from a user's filename, so an upload named ``../../etc/passwd`` is only ever a
display name. Two stores, chosen by ``TIDAL_FILES_URL``:

* :class:`LocalFileStore` (the embedded default): a directory, ``TIDAL_FILES_DIR``. Gateways and
  workers must share it, so they run on one host (or share a volume).
* ``PostgresFileStore`` (``TIDAL_FILES_URL=postgresql://...``): large objects in PostgreSQL, so
  gateways and workers on different hosts share files through the database
  (:mod:`batch_jobs.files_postgres`).

Example::

    files = file_store_from_settings(settings)
    ref, size = await files.save_stream("acme", "file-abc", chunks)
    with files.open(ref) as f:
        for line in f: ...
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import AsyncIterator, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, Protocol

if TYPE_CHECKING:
    from tidal.settings import Settings

__all__ = [
    "FileStore",
    "FileTooLarge",
    "LocalFileStore",
    "Readable",
    "StoredFile",
    "file_ref",
    "file_store_from_settings",
    "new_id",
    "safe_filename",
]


class FileTooLarge(Exception):
    """The upload went past the size limit; nothing was kept."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"file exceeds the limit of {limit} bytes")
        self.limit = limit


def new_id(prefix: str) -> str:
    """OpenAI-style ids: ``file-…``, ``batch_…``, ``job_…``."""
    return f"{prefix}{secrets.token_hex(12)}"


_UNSAFE = re.compile(r"[^A-Za-z0-9._ -]+")


def safe_filename(name: str | None, default: str = "upload.jsonl") -> str:
    """A display name: the last path component, odd characters replaced, at most 255 long."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = _UNSAFE.sub("_", base).strip(" .")
    return (base or default)[:255]


def file_ref(tenant: str, file_id: str) -> str:
    """The reference every store files ``file_id`` under: ``<tenant hash>/<file id>``."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", file_id):
        raise ValueError("bad file id")
    return f"{hashlib.sha256(tenant.encode()).hexdigest()[:24]}/{file_id}"


class FileStore(Protocol):
    """Bytes by reference, written and read as streams (a file may be gigabytes).

    A write becomes visible whole or not at all: a refused or broken upload leaves nothing, and a
    reader never sees a file that is still being written.
    """

    @property
    def max_bytes(self) -> int:
        """The upload limit that :meth:`save_stream` enforces as bytes arrive."""
        ...

    async def save_stream(self, tenant: str, file_id: str, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        """Store an upload; raises :class:`FileTooLarge` past ``max_bytes``. Returns (ref, size)."""
        ...

    def save_lines(self, tenant: str, file_id: str, lines: Iterable[bytes | str]) -> tuple[str, int]:
        """Store generated content (output files, reports) line by line. Returns (ref, size)."""
        ...

    def open(self, ref: str) -> BinaryIO:
        """The file for a streaming read (iterate it by line, or ``read(n)``); close it after.
        Raises ``FileNotFoundError`` when there is none."""
        ...

    def exists(self, ref: str) -> bool: ...

    def delete(self, ref: str) -> None:
        """Remove the file; a missing one is not an error."""
        ...


class Readable(Protocol):
    """Bytes that can be read from the start as often as needed: a ``Path`` or a :class:`StoredFile`."""

    def open(self, mode: Literal["rb"]) -> BinaryIO: ...


@dataclass(frozen=True)
class StoredFile:
    """A file in a store, opened like a ``Path`` (``with f.open("rb") as fh: ...``)."""

    store: FileStore
    ref: str

    def open(self, mode: Literal["rb"] = "rb") -> BinaryIO:
        return self.store.open(self.ref)


class LocalFileStore:
    """Bytes under one root directory, one sub-directory per tenant (by hash); a write goes to a
    ``.part`` file renamed into place when complete."""

    def __init__(self, root: Path, *, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def path(self, ref: str) -> Path:
        p = (self.root / ref).resolve()
        if self.root.resolve() not in p.parents:
            raise ValueError("path escapes the files directory")
        return p

    async def save_stream(self, tenant: str, file_id: str, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        ref = file_ref(tenant, file_id)
        dest = self.path(ref)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        size = 0
        try:
            with tmp.open("wb") as out:
                async for piece in chunks:
                    size += len(piece)
                    if size > self.max_bytes:
                        raise FileTooLarge(self.max_bytes)
                    out.write(piece)
            os.replace(tmp, dest)
        except BaseException:
            with suppress(OSError):
                tmp.unlink()
            raise
        return ref, size

    def save_lines(self, tenant: str, file_id: str, lines: Iterable[bytes | str]) -> tuple[str, int]:
        ref = file_ref(tenant, file_id)
        dest = self.path(ref)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        size = 0
        try:
            with tmp.open("wb") as out:
                for line in lines:
                    data = line.encode() if isinstance(line, str) else line
                    out.write(data)
                    size += len(data)
            os.replace(tmp, dest)
        except BaseException:
            with suppress(OSError):
                tmp.unlink()
            raise
        return ref, size

    def open(self, ref: str) -> BinaryIO:
        return self.path(ref).open("rb")

    def exists(self, ref: str) -> bool:
        return self.path(ref).is_file()

    def delete(self, ref: str) -> None:
        with suppress(OSError):
            self.path(ref).unlink()


def file_store_from_settings(settings: Settings) -> FileStore:
    """The store ``TIDAL_FILES_URL`` names (PostgreSQL), else the local ``TIDAL_FILES_DIR``."""
    if settings.files_url is None:
        return LocalFileStore(settings.resolved_files_dir, max_bytes=settings.max_file_bytes)
    from tidal.batch_jobs.files_postgres import PostgresFileStore

    return PostgresFileStore(settings.files_url, max_bytes=settings.max_file_bytes)
