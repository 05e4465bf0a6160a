"""/v1/files: batch input files uploaded into Redis as a stream, and every file's content streamed back.

An upload (multipart/form-data, purpose `batch`) goes from the socket through python-multipart's streaming
parser into `batches.file_store.FileUpload`, a chunk at a time: the gateway never holds a whole file. A batch's
output and error files (`<batch id>_output`, `<batch id>_errors`) are rendered from the batch's lines in
input order while they download (partial while the batch still runs).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from rqbatcher.batches.batch_object import Batch, batch_of_file
from rqbatcher.batches.file_store import (
    DEFAULT_FILE_RETENTION_S,
    MAX_FILE_RETENTION_S,
    MIN_FILE_RETENTION_S,
    PURPOSES,
    FileNotFound,
    FileObject,
    FileStore,
    FileTooLarge,
)
from rqbatcher.batches.store import BatchStore
from rqbatcher.errors import quoted, short_name
from rqbatcher.gateway.body import BodyReader
from rqbatcher.gateway.error_objects import ApiError

FORM_OVERHEAD_BYTES = 64 * 1024  # an upload's other fields and part headers, beyond the file's own limit
MAX_FIELD_BYTES = 1024  # purpose, expires_after[...]: short values
FILE_FIELD = "file"
FORM_FIELDS = (FILE_FIELD, "purpose", "expires_after[anchor]", "expires_after[seconds]")  # OpenAI's, and no other
DOWNLOAD_BLOCK_BYTES = 64 * 1024  # rendered lines are sent in blocks of about this size
CONTENT_TYPE = "application/jsonl"
OUTPUT_PURPOSE = "batch_output"
HIDDEN_FIELDS = {"owner", "lines"}


def file_json(file: FileObject) -> dict:
    return file.model_dump(mode="json", exclude=HIDDEN_FIELDS)


class _Parts:
    """python-multipart's callbacks, turned into a list of events read after each write:
    ("part", name, filename), ("data", bytes), ("end",)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._name, self._value, self._disposition = b"", b"", b""

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._field, "on_header_value": self._header_value,
                "on_header_end": self._header_end, "on_headers_finished": self._headers_finished,
                "on_part_data": self._data, "on_part_end": self._end}

    def take(self) -> list[tuple]:
        events, self.events = self.events, []
        return events

    def _begin(self) -> None:
        self._disposition = b""

    def _field(self, data: bytes, start: int, end: int) -> None:
        self._name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._name.strip().lower() == b"content-disposition":
            self._disposition = self._value
        self._name, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._disposition)
        filename = params.get(b"filename")
        self.events.append(("part", params.get(b"name", b"").decode("utf-8", "replace"),
                            None if filename is None else filename.decode("utf-8", "replace")))

    def _data(self, data: bytes, start: int, end: int) -> None:
        self.events.append(("data", data[start:end]))

    def _end(self) -> None:
        self.events.append(("end",))


async def create_file(request: Request) -> JSONResponse:
    store: FileStore = request.app.state.files
    content_type, params = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data" or b"boundary" not in params:
        raise ApiError(400, "Upload the file as multipart/form-data, with the fields `file` and `purpose`.")
    reader = BodyReader(request, store.limits.max_bytes + FORM_OVERHEAD_BYTES, code="file_too_large", what="upload")
    parts = _Parts()
    parser = MultipartParser(params[b"boundary"], parts.callbacks())
    upload = store.upload()
    fields: dict[str, bytes] = {}
    filename, current = None, None
    try:
        async for chunk in reader.chunks():
            parser.write(chunk)
            file_data = bytearray()
            for event in parts.take():
                if event[0] == "part":
                    current = event[1]
                    if current not in FORM_FIELDS:
                        raise ApiError(400, f"unsupported form field {short_name(current)}: an upload has the fields "
                                            f"{', '.join(FORM_FIELDS)}", param=current)
                    if current == FILE_FIELD:
                        filename = event[2] or FILE_FIELD
                elif event[0] == "data" and current == FILE_FIELD:
                    file_data += event[1]
                elif event[0] == "data":
                    fields[current] = fields.get(current, b"") + event[1]
                    if len(fields[current]) > MAX_FIELD_BYTES:
                        raise ApiError(400, f"The field {current} is longer than {MAX_FIELD_BYTES} bytes.",
                                       param=current)
                else:
                    current = None
            if file_data:
                await run_in_threadpool(upload.write, bytes(file_data))
        parser.finalize()
        purpose, retention_s = _form(fields, filename)
        created = await run_in_threadpool(upload.finish, filename=filename, purpose=purpose,
                                          owner=request.state.tenant, retention_s=retention_s)
    except FileTooLarge:
        await reader.drain()
        await run_in_threadpool(upload.abort)
        raise
    except MultipartParseError as exc:
        await run_in_threadpool(upload.abort)
        raise ApiError(400, f"The multipart body is malformed: {exc}") from None
    except BaseException:
        await run_in_threadpool(upload.abort)
        raise
    return JSONResponse(file_json(created))


def _form(fields: dict[str, bytes], filename: str | None) -> tuple[str, int]:
    """(purpose, retention) from an upload's fields, as OpenAI names them."""
    if filename is None:
        raise ApiError(400, "The upload has no `file` field.", param=FILE_FIELD)
    purpose = fields.get("purpose", b"").decode("utf-8", "replace")
    if purpose not in PURPOSES:
        raise ApiError(400, f"purpose must be one of {', '.join(PURPOSES)}; got {quoted(purpose)}", param="purpose")
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return purpose, DEFAULT_FILE_RETENTION_S
    if anchor != b"created_at" or seconds is None or not seconds.isdigit() or not (
            MIN_FILE_RETENTION_S <= int(seconds) <= MAX_FILE_RETENTION_S):
        raise ApiError(400, f"expires_after is anchor `created_at` and {MIN_FILE_RETENTION_S} to "
                            f"{MAX_FILE_RETENTION_S} seconds", param="expires_after")
    return purpose, int(seconds)


def _found(request: Request) -> tuple[FileObject, Batch | None, bool]:
    """(the file, its batch and whether it is the error file, for a batch's output file). Runs in a thread."""
    file_id, tenant = request.path_params["file_id"], request.state.tenant
    of_batch = batch_of_file(file_id)
    if of_batch is None:
        return request.app.state.files.get(file_id, tenant), None, False
    batch, errors = _batch_of(request, file_id)
    size = sum(len(block) for block in _blocks(_batch_lines(request, batch, errors)))
    ended = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at or batch.created_at
    return FileObject(id=file_id, bytes=size, created_at=ended, expires_at=batch.output_expires_at,
                      filename=f"{file_id}.jsonl", purpose=OUTPUT_PURPOSE), batch, errors


def _batch_of(request: Request, file_id: str) -> tuple[Batch, bool]:
    """(the batch, whether it is the error file) of a batch's output or error file; FileNotFound past the files'
    expiry (their lines are gone then, or about to go). Runs in a thread."""
    batch_id, errors = batch_of_file(file_id)
    batch = BatchStore(request.app.state.client.connection).get(batch_id, request.state.tenant)
    if batch.output_expires_at is not None and time.time() >= batch.output_expires_at:
        raise FileNotFound(f"no file {file_id} (past its expiry at {batch.output_expires_at})")
    return batch, errors


def _batch_lines(request: Request, batch: Batch, errors: bool) -> Iterator[str]:
    return BatchStore(request.app.state.client.connection).lines(batch, errors)


def _blocks(lines: Iterable[str]) -> Iterator[bytes]:
    """Lines joined into blocks of about DOWNLOAD_BLOCK_BYTES (one thread hop per block, not per line)."""
    block, size = [], 0
    for line in lines:
        data = line.encode()
        block.append(data)
        size += len(data)
        if size >= DOWNLOAD_BLOCK_BYTES:
            yield b"".join(block)
            block, size = [], 0
    if block:
        yield b"".join(block)


async def retrieve_file(request: Request) -> JSONResponse:
    found, _, _ = await run_in_threadpool(_found, request)
    return JSONResponse(file_json(found))


async def file_content(request: Request) -> StreamingResponse:
    file_id, tenant = request.path_params["file_id"], request.state.tenant
    of_batch = batch_of_file(file_id)
    if of_batch is None:
        store: FileStore = request.app.state.files
        await run_in_threadpool(store.get, file_id, tenant)
        return StreamingResponse(store.content(file_id), media_type=CONTENT_TYPE)
    batch, errors = await run_in_threadpool(_batch_of, request, file_id)
    return StreamingResponse(_blocks(_batch_lines(request, batch, errors)), media_type=CONTENT_TYPE)


async def delete_file(request: Request) -> JSONResponse:
    file_id = request.path_params["file_id"]
    if batch_of_file(file_id) is not None:
        raise ApiError(400, "A batch's output and error files live as long as the batch; they cannot be deleted "
                            "alone.", param="file_id")
    await run_in_threadpool(request.app.state.files.delete, file_id, request.state.tenant)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
