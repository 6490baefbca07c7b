"""Files on local disk: uploads (batch input, job datasets) and generated outputs.

Paths are built from the tenant's hash and a random file id, never from a user's filename, so an
upload named ``../../etc/passwd`` is only ever a display name.

Example::

    files = FileStore(settings.resolved_files_dir, max_bytes=settings.max_file_bytes)
    rel, size = await files.save_stream("acme", "file-abc", chunks)
    with files.open(rel) as f: ...
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import AsyncIterator, Iterable
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO

__all__ = ["FileStore", "FileTooLarge", "new_id", "safe_filename"]


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


class FileStore:
    """Bytes under one root directory, one sub-directory per tenant (by hash)."""

    def __init__(self, root: Path, *, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def _rel(self, tenant: str, file_id: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", file_id):
            raise ValueError("bad file id")
        tdir = hashlib.sha256(tenant.encode()).hexdigest()[:24]
        return f"{tdir}/{file_id}"

    def path(self, rel: str) -> Path:
        p = (self.root / rel).resolve()
        if self.root.resolve() not in p.parents:
            raise ValueError("path escapes the files directory")
        return p

    async def save_stream(self, tenant: str, file_id: str, chunks: AsyncIterator[bytes]) -> tuple[str, int]:
        """Write an upload, enforcing the size limit as bytes arrive; returns (relative path, size)."""
        rel = self._rel(tenant, file_id)
        dest = self.path(rel)
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
        return rel, size

    def save_lines(self, tenant: str, file_id: str, lines: Iterable[bytes | str]) -> tuple[str, int]:
        """Write generated content (output files, reports) line by line; returns (path, size)."""
        rel = self._rel(tenant, file_id)
        dest = self.path(rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        size = 0
        with tmp.open("wb") as out:
            for line in lines:
                data = line.encode() if isinstance(line, str) else line
                out.write(data)
                size += len(data)
        os.replace(tmp, dest)
        return rel, size

    def save_bytes(self, tenant: str, file_id: str, data: bytes) -> tuple[str, int]:
        return self.save_lines(tenant, file_id, [data])

    def open(self, rel: str) -> BinaryIO:
        return self.path(rel).open("rb")

    def delete(self, rel: str) -> None:
        with suppress(OSError):
            self.path(rel).unlink()
