"""OpenAI Files: upload batch inputs and job datasets, read generated outputs.

Example (the official SDK, unchanged)::

    f = client.files.create(file=open("in.jsonl", "rb"), purpose="batch")
    client.files.content(batch.output_file_id).text
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, BinaryIO
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from tidal.api.batch_tier import batch_errors
from tidal.api.deps import BatchDep, PrincipalDep
from tidal.api.errors import APIError
from tidal.batch_jobs.models import FilePublic, ListPage

__all__ = ["router"]

router = APIRouter(tags=["files"])

_MULTIPART_OVERHEAD = 64 * 1024  # form fields and boundaries around the file itself
_READ_CHUNK = 1 << 20


class _BodyTooLarge(Exception):
    pass


async def _limited(stream: AsyncIterator[bytes], limit: int) -> AsyncGenerator[bytes, None]:
    seen = 0
    async for piece in stream:
        seen += len(piece)
        if seen > limit:
            raise _BodyTooLarge
        yield piece


async def _upload_chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while piece := await upload.read(_READ_CHUNK):
        yield piece


async def _download_chunks(reader: BinaryIO) -> AsyncIterator[bytes]:
    # Reads block (a disk, or PostgreSQL for a shared store): each goes to a worker thread.
    try:
        while piece := await run_in_threadpool(reader.read, _READ_CHUNK):
            yield piece
    finally:
        reader.close()  # also when the client leaves mid-download


def _attachment(filename: str) -> str:
    # As Starlette's FileResponse says it (display names are ASCII; see safe_filename).
    quoted = quote(filename)
    return (
        f"attachment; filename*=utf-8''{quoted}"
        if quoted != filename
        else f'attachment; filename="{filename}"'
    )


@router.post("/v1/files", summary="Upload a file (multipart: file, purpose)")
async def create_file(request: Request, principal: PrincipalDep, svc: BatchDep) -> FilePublic:
    limit = svc.files.max_bytes
    too_large = APIError(
        413, f"The file is larger than the limit of {limit} bytes.", param="file", code="file_too_large"
    )
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit + _MULTIPART_OVERHEAD:
        raise too_large  # refuse before reading a byte
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(
            400,
            "Upload files as multipart/form-data with fields 'file' and 'purpose'.",
            code="invalid_request",
        )
    parser = MultiPartParser(
        request.headers, _limited(request.stream(), limit + _MULTIPART_OVERHEAD), max_files=1, max_fields=8
    )
    try:
        form = await parser.parse()
    except _BodyTooLarge:
        raise too_large from None
    except MultiPartException as exc:
        raise APIError(400, f"Bad multipart body: {exc.message}", code="invalid_request") from None
    try:
        upload = form.get("file")
        purpose = form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "Missing the 'file' field.", param="file", code="missing_required_parameter")
        if not isinstance(purpose, str):
            raise APIError(
                400, "Missing the 'purpose' field.", param="purpose", code="missing_required_parameter"
            )
        seconds = form.get("expires_after[seconds]")
        expires = int(seconds) if isinstance(seconds, str) and seconds.isdigit() else None
        with batch_errors():
            rec = await svc.upload_file(
                principal.tenant,
                filename=upload.filename,
                purpose=purpose,
                chunks=_upload_chunks(upload),
                expires_after_s=expires,
            )
        return FilePublic.of(rec)
    finally:
        await form.close()


@router.get("/v1/files", summary="List your files")
async def list_files(
    principal: PrincipalDep,
    svc: BatchDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> ListPage:
    with batch_errors():
        return await run_in_threadpool(
            svc.list_files, principal.tenant, purpose=purpose, after=after, limit=limit, order=order
        )


@router.get("/v1/files/{file_id}", summary="Describe a file")
async def retrieve_file(file_id: str, principal: PrincipalDep, svc: BatchDep) -> FilePublic:
    with batch_errors():
        return FilePublic.of(await run_in_threadpool(svc.get_file, principal.tenant, file_id))


@router.get("/v1/files/{file_id}/content", summary="The file's bytes", response_model=None)
async def file_content(file_id: str, principal: PrincipalDep, svc: BatchDep) -> StreamingResponse:
    with batch_errors():
        rec = await run_in_threadpool(svc.get_file, principal.tenant, file_id)
    reader = await run_in_threadpool(svc.files.open, rec.path)
    media = "application/octet-stream" if rec.filename.endswith(".npy") else "application/jsonl"
    return StreamingResponse(
        _download_chunks(reader),
        media_type=media,
        headers={"Content-Length": str(rec.bytes), "Content-Disposition": _attachment(rec.filename)},
    )


@router.delete("/v1/files/{file_id}", summary="Delete a file")
async def delete_file(file_id: str, principal: PrincipalDep, svc: BatchDep) -> dict[str, Any]:
    with batch_errors():
        await run_in_threadpool(svc.delete_file, principal.tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
