"""Files uploaded for batches (OpenAI's Files API, `purpose=batch`), kept in Redis so that every gateway replica
serves every file.

Redis holds, per file (every key is named in batcher/jobs/keys.py):
- `batcher:file:<id>`: a hash with the File object's fields and the owner;
- `batcher:file:<id>:chunks`: a list of the file's bytes, in upload order, in chunks of CHUNK_BYTES.
An upload is written chunk by chunk while it arrives (`FileUpload`), so no process holds a whole file. Its limits
(bytes, lines) are checked on the way. The hash is written last: a file is visible only once it is whole, and the
chunks of an abandoned upload expire after UPLOAD_TTL_S. A batch reads a file back as a stream of lines (`lines`).

Batch output and error files are not stored here: they are rendered from the batch's own lines
(batcher/batches/lines.py), and live as long as the batch or as its `output_expires_after` says.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from redis import Redis

from rqbatcher.errors import BatcherError, InvalidName
from rqbatcher.jobs import keys
from rqbatcher.jobs.redis_text import as_text

CHUNK_BYTES = 256 * 1024  # bytes per list item: one Redis write per chunk, one chunk in memory at a time
UPLOAD_TTL_S = 3600  # the chunks of an upload that never finished
DEFAULT_FILE_RETENTION_S = 30 * 86400  # OpenAI keeps a batch input file 30 days unless told otherwise
MIN_FILE_RETENTION_S = 3600  # the range of OpenAI's `expires_after.seconds`
MAX_FILE_RETENTION_S = 30 * 86400
DEFAULT_MAX_FILE_BYTES = 200 * 2**20  # OpenAI's limit on a batch input file
DEFAULT_MAX_FILE_LINES = 50_000  # OpenAI's limit on the requests of one batch
PURPOSES = ("batch",)


class FileNotFound(BatcherError, LookupError):
    """No such file: never uploaded, deleted, past its retention, or another owner's."""


class FileTooLarge(BatcherError, ValueError):
    """An upload past a limit; `code` says which (file_too_large, too_many_lines)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class FileLimits:
    max_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_lines: int = DEFAULT_MAX_FILE_LINES


class FileObject(BaseModel):
    """OpenAI's File object; `owner` and `lines` are ours."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    owner: str | None = None
    lines: int | None = None

    @classmethod
    def from_hash(cls, raw: dict) -> FileObject:
        h = {as_text(k): as_text(v) for k, v in raw.items()}
        return cls(id=h["id"], bytes=int(h["bytes"]), created_at=int(h["created_at"]),
                   expires_at=int(h["expires_at"]), filename=h["filename"], purpose=h["purpose"],
                   owner=h.get("owner") or None, lines=int(h["lines"]))


def new_file_id() -> str:
    return keys.FILE_ID_PREFIX + uuid.uuid4().hex


class FileUpload:
    """One upload in progress: `write` its bytes as they arrive, then `finish` (or `abort`)."""

    def __init__(self, connection: Redis, limits: FileLimits) -> None:
        self.connection, self.limits = connection, limits
        self.id = new_file_id()
        self.size = 0
        self._newlines = 0
        self._ends_with_newline = True
        self._buffer = bytearray()

    @property
    def lines(self) -> int:
        return self._newlines + (0 if self._ends_with_newline else 1)

    def write(self, data: bytes) -> None:
        """Take the next bytes of the file; raise FileTooLarge once it passes a limit."""
        if not data:
            return
        self.size += len(data)
        if self.size > self.limits.max_bytes:
            raise FileTooLarge(f"the file is larger than the limit of {self.limits.max_bytes} bytes", "file_too_large")
        self._newlines += data.count(b"\n")
        self._ends_with_newline = data.endswith(b"\n")
        if self.lines > self.limits.max_lines:
            raise FileTooLarge(f"the file has more than the limit of {self.limits.max_lines} lines", "too_many_lines")
        self._buffer += data
        if len(self._buffer) >= CHUNK_BYTES:
            self._flush(whole_chunks_only=True)

    def _flush(self, whole_chunks_only: bool = False) -> None:
        """Store the buffer as chunks of CHUNK_BYTES (and the rest too, unless `whole_chunks_only`)."""
        size = len(self._buffer) - len(self._buffer) % CHUNK_BYTES if whole_chunks_only else len(self._buffer)
        if size:
            key = keys.file_chunks_key(self.id)
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.rpush(key, *[bytes(self._buffer[i:i + CHUNK_BYTES]) for i in range(0, size, CHUNK_BYTES)])
                pipe.expire(key, UPLOAD_TTL_S)
                pipe.execute()
            del self._buffer[:size]

    def finish(self, *, filename: str, purpose: str, owner: str | None,
               retention_s: int = DEFAULT_FILE_RETENTION_S) -> FileObject:
        """Store the last chunk and the File object: the file exists from now on, for `retention_s`."""
        self._flush()
        now = int(time.time())
        fields = {"id": self.id, "bytes": self.size, "created_at": now, "expires_at": now + retention_s,
                  "filename": filename, "purpose": purpose, "owner": owner and keys.check_owner(owner) or "",
                  "lines": self.lines}
        with self.connection.pipeline() as pipe:
            pipe.hset(keys.file_key(self.id), mapping=fields)
            pipe.expire(keys.file_key(self.id), retention_s)
            pipe.expire(keys.file_chunks_key(self.id), retention_s)
            pipe.execute()
        return FileObject.from_hash(fields)

    def abort(self) -> None:
        self._buffer.clear()
        self.connection.delete(keys.file_chunks_key(self.id))


class FileStore:
    """Uploaded files in Redis: upload, read, stream back, delete."""

    def __init__(self, connection: Redis, limits: FileLimits = FileLimits()) -> None:
        self.connection, self.limits = connection, limits

    def upload(self) -> FileUpload:
        return FileUpload(self.connection, self.limits)

    def get(self, file_id: str, owner: str | None = None) -> FileObject:
        """The file; another owner's is not found (with `owner` None, every file is visible)."""
        try:
            raw = self.connection.hgetall(keys.file_key(file_id))
        except InvalidName:
            raw = None
        if not raw:
            raise FileNotFound(f"no file {file_id} (never uploaded, deleted, or past its retention)")
        found = FileObject.from_hash(raw)
        if owner is not None and found.owner != owner:
            raise FileNotFound(f"no file {file_id} (never uploaded, deleted, or past its retention)")
        return found

    def content(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes as uploaded, one chunk at a time."""
        key = keys.file_chunks_key(file_id)
        index = 0
        while True:
            chunk = self.connection.lrange(key, index, index)
            if not chunk:
                return
            yield chunk[0]
            index += 1

    def lines(self, file_id: str) -> Iterator[bytes]:
        """The file's lines (without their line breaks), read one chunk at a time."""
        rest = b""
        for chunk in self.content(file_id):
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            yield from parts
        if rest:
            yield rest

    def delete(self, file_id: str, owner: str | None = None) -> None:
        self.get(file_id, owner)
        self.connection.delete(keys.file_key(file_id), keys.file_chunks_key(file_id))
