"""Batches: the jobs of one OpenAI batch file, tracked as one (status, counts, output files).

Redis holds, per batch (every key is named in batcher/keys.py; the scripts are in batcher/batch_scripts.py):
- `batcher:batch:<id>`: a hash with the Batch object's fields: status, counts, timestamps, metadata;
- `batcher:batch:<id>:custom_ids`: a list of the lines' custom_ids in input order;
- `batcher:batch:<id>:lines`: a hash, input index -> that request's output or error line;
- `batcher:feed:<id>`: the batch's completion feed (batcher/feed.py).
Job i of batch B has the id `B-i`, so the batch keeps no list of job ids: a queue or a registry is
searched for the batch's jobs by that prefix, and a job's index is in its own argument (BatchItem).

Counts are exact through crashes and retries: a job's outcome is written by one Lua script that runs
inside the transaction recording the job's result (`record_job_end`). The script writes the line with
HSETNX, and counts it only if it was new, so whoever records an index first wins and a repeated or
late write (a retried job, a job stopped after its batch was cancelled) changes nothing. That is O(1)
Redis work per job, with no scan over the batch. The same script moves the batch to `completed` (or
`cancelled`) when the last line is written.

Output and error files are rendered from the stored lines in input order, streamed in chunks. They
live as long as the batch (`retention_s` from its creation), whatever RQ's result TTL is.

Cancel and expiry share one sweep: the batch's queued jobs are taken out of their queues in one pass
per queue, every index without a line gets a `batch_cancelled` (or `batch_expired`) error line, then
the running jobs get RQ's stop-job command (the worker aborts them within one step; their late
outcome is not counted). Expiry is enforced twice: each job carries the batch's deadline, which a
worker checks on admission, so an expired batch never costs a forward pass even if nobody looks at
it; and whoever reads the batch first after its deadline (a status poll, a listing, a gateway)
marks it `expired` and runs the sweep, so running jobs stop and the counts add up.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from redis import Redis
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer

from batcher import batch_scripts as scripts
from batcher import keys
from batcher.openai_batch import CHAT_URL, COMPLETIONS_URL, error_line, response_line
from batcher.schema import BatchItem, GenerationRequest, GenerationResult

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
ACTIVE = ("validating", "in_progress")  # statuses a cancel or an expiry can still end
ENDED = ("failed", "completed", "expired", "cancelled")
WINDOW_PATTERN = re.compile(r"(\d+)([smhd])")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_COMPLETION_WINDOW = "24h"  # OpenAI's only window; any `<n>s|m|h|d` works here
DEFAULT_BATCH_RETENTION_S = 7 * 86400  # a batch, its lines and its feed, counted from its creation
MAX_METADATA_ITEMS = 16  # OpenAI's limits on a batch's metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
FEED_MAXLEN = 100_000  # entries kept per feed stream (trimmed approximately)
CHUNK = 1000  # lines per pipeline when creating, sweeping or rendering a batch
OUTPUT_KIND, ERROR_KIND = "o", "e"  # the first character of a stored line says which file it goes to

class BatchNotFound(LookupError):
    """No such batch: never created, past its retention, or another owner's."""


class BatchInputError(ValueError):
    """The batch cannot be created as asked (window, metadata, endpoint, or an empty file)."""


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class Batch(BaseModel):
    """OpenAI's Batch object, as a gateway serves it; `owner`, `queue` and `model` are ours."""

    model_config = ConfigDict(frozen=True)

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str | None = None
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    owner: str | None = None
    queue: str
    model: str | None = None

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @classmethod
    def from_hash(cls, raw: dict) -> Batch:
        h = {_text(k): _text(v) for k, v in raw.items()}
        counts = RequestCounts(total=int(h.get("total", 0)), completed=int(h.get("completed", 0)),
                               failed=int(h.get("failed", 0)))
        ended = h["status"] in ENDED
        times = {f: int(float(h[f])) for f in ("created_at", "in_progress_at", "expires_at", "finalizing_at",
                                               "completed_at", "failed_at", "expired_at", "cancelling_at",
                                               "cancelled_at") if h.get(f)}
        return cls(
            id=h["id"], endpoint=h["endpoint"], completion_window=h["completion_window"], status=h["status"],
            errors=BatchErrors.model_validate_json(h["errors"]) if h.get("errors") else None,
            input_file_id=h.get("input_file_id") or None, request_counts=counts,
            output_file_id=output_file_id(h["id"]) if ended and counts.completed else None,
            error_file_id=error_file_id(h["id"]) if ended and counts.failed else None,
            metadata=json.loads(h["metadata"]) if h.get("metadata") else None,
            owner=h.get("owner") or None, queue=h["queue"], model=h.get("model") or None, **times)


def output_file_id(batch_id: str) -> str:
    return f"{batch_id}_output"


def error_file_id(batch_id: str) -> str:
    return f"{batch_id}_errors"


def batch_of_file(file_id: str) -> tuple[str, bool] | None:
    """(batch id, whether it is the error file) of a batch's output or error file id; None for any other id."""
    for suffix, errors in ((output_file_id(""), False), (error_file_id(""), True)):
        if isinstance(file_id, str) and file_id.startswith(keys.BATCH_ID_PREFIX) and file_id.endswith(suffix):
            return file_id[:-len(suffix)], errors
    return None


def parse_window(window: str) -> int:
    """Seconds in a completion window such as `24h`, `30m`, `45s` or `2d`."""
    match = WINDOW_PATTERN.fullmatch(window) if isinstance(window, str) else None
    if match is None or int(match.group(1)) < 1:
        raise BatchInputError(f"completion_window is a number and a unit (s, m, h, d), such as 24h; got {window!r}")
    return int(match.group(1)) * WINDOW_UNITS[match.group(2)]


def check_metadata(metadata: dict | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_ITEMS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS
            and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items()):
        raise BatchInputError(f"metadata has at most {MAX_METADATA_ITEMS} string keys of up to "
                              f"{MAX_METADATA_KEY_CHARS} characters, with string values of up to "
                              f"{MAX_METADATA_VALUE_CHARS}")
    return dict(metadata)


def new_batch_id() -> str:
    return keys.BATCH_ID_PREFIX + uuid.uuid4().hex


# ----- what the worker calls when a job ends -----
def record_job_end(pipe, *, job_id: str, queue: str, status: str, request: GenerationRequest | None,
                   result: GenerationResult | None = None, reason: str | None = None,
                   now: float | None = None) -> None:
    """Queue on `pipe` (a pipeline in MULTI, the one that records the job's result) the commands that
    report the job's end: its batch line and counts, and its completion-feed entries.

    `status` is how the job ended: finished (with `result`), failed (with `reason`) or stopped (with the
    partial `result`); `queue` is its RQ queue; `request` is what it carried (None if it carried
    nothing readable). A job recorded twice changes nothing the second time."""
    now = time.time() if now is None else now
    item = request.batch if request is not None else None
    if item is not None and job_id != keys.batch_job_id(item.id, item.index):
        item = None  # a batch's jobs are created by create_batch with derived ids: any other job is no part of it
    finish_reason = result.finish_reason if result is not None else ""
    base = keys.base_queue(queue)
    entry = (job_id, status, "" if item is None else item.custom_id or "", "" if item is None else item.id,
             base, finish_reason or "")
    if item is None:
        pipe.xadd(keys.queue_feed_key(base), dict(zip(("job_id", "status", "custom_id", "batch_id", "queue",
                                                       "finish_reason"), entry)),
                  maxlen=FEED_MAXLEN, approximate=True)
        return
    if status == "finished":
        endpoint = CHAT_URL if request.messages is not None else COMPLETIONS_URL
        kind, line = "completed", OUTPUT_KIND + json.dumps(
            response_line(item.custom_id, result, endpoint, request_id=job_id, created=int(now)))
    else:
        message = reason or "stopped before it finished"
        kind, line = "failed", ERROR_KIND + json.dumps(
            error_line(item.custom_id, message, "cancelled" if status == "stopped" else "generation_failed",
                       request_id=job_id))
    expired = ERROR_KIND + json.dumps(error_line(item.custom_id, EXPIRED_MESSAGE, "batch_expired",
                                                 request_id=job_id)) if kind == "failed" else ""
    batch_keys = [keys.batch_key(item.id), keys.batch_lines_key(item.id), keys.batch_feed_key(item.id),
                  keys.queue_feed_key(base)]
    scripts.run(pipe, scripts.RECORD, batch_keys, [item.index, kind, line, expired, now, FEED_MAXLEN, *entry])


EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
CANCELLED_MESSAGE = "The batch was cancelled before this request finished."
SWEEPS = {"cancelled": ("batch_cancelled", CANCELLED_MESSAGE), "expired": ("batch_expired", EXPIRED_MESSAGE)}


class BatchStore:
    """Batches in Redis: create, read, list, cancel, expire and render them."""

    def __init__(self, connection: Redis) -> None:
        self.connection = connection
        self._bases: dict[str, str] = {}

    # ----- create -----
    def begin(self, *, endpoint: str, completion_window: str, queue: str, model: str | None = None,
              metadata: dict | None = None, owner: str | None = None, input_file_id: str | None = None,
              retention_s: int = DEFAULT_BATCH_RETENTION_S, batch_id: str | None = None) -> Batch:
        """Store a new batch, `validating`, with no requests yet."""
        if endpoint not in (COMPLETIONS_URL, CHAT_URL):
            raise BatchInputError(f"endpoint must be {COMPLETIONS_URL} or {CHAT_URL}, got {endpoint!r}")
        window_s = parse_window(completion_window)
        if retention_s <= window_s:
            raise BatchInputError(f"the retention ({retention_s} s) must outlast the completion window ({window_s} s)")
        metadata = check_metadata(metadata)
        batch_id = keys.check_batch_id(batch_id or new_batch_id())
        now = time.time()  # expires_at is whole seconds, as the Batch object shows it and jobs carry it
        fields = {"id": batch_id, "endpoint": endpoint, "completion_window": completion_window,
                  "status": "validating", "created_at": now, "expires_at": int(now) + window_s, "queue": keys.check_queue(queue),
                  "total": 0, "completed": 0, "failed": 0, "queues": ""}
        for name, value in (("model", model), ("owner", owner and keys.check_owner(owner)),
                            ("input_file_id", input_file_id), ("metadata", metadata and json.dumps(metadata))):
            if value:
                fields[name] = value
        with self.connection.pipeline() as pipe:
            pipe.hset(keys.batch_key(batch_id), mapping=fields)
            pipe.expire(keys.batch_key(batch_id), retention_s)
            pipe.zadd(keys.BATCH_INDEX, {batch_id: now})
            if owner:
                pipe.zadd(keys.batch_owner_index(owner), {batch_id: now})
            pipe.execute()
        return Batch.from_hash(fields)

    def add_lines(self, pipe, batch_id: str, first_index: int, custom_ids: list[str | None],
                  bad: dict[int, tuple[str | None, str]], rq_queues: set[str], retention_s: int) -> None:
        """Queue on `pipe` the bookkeeping of lines `first_index...`: their custom_ids, the new total, and
        an error line for each bad one (`bad`: index -> (custom_id, reason))."""
        key = keys.batch_key(batch_id)
        ids_key = keys.batch_custom_ids_key(batch_id)
        pipe.rpush(ids_key, *[json.dumps(c) for c in custom_ids])
        pipe.expire(ids_key, retention_s)
        pipe.hset(key, mapping={"total": first_index + len(custom_ids), "queues": ",".join(sorted(rq_queues))})
        now = time.time()
        for index, (custom_id, reason) in bad.items():
            self._write_line(pipe, batch_id, index, custom_id, "invalid_request", reason, "failed", now)

    def start(self, batch_id: str) -> Batch:
        """Validation is over: the batch runs, or ends at once if every line has ended already."""
        scripts.run(self.connection, scripts.START, [keys.batch_key(batch_id)], [time.time()])
        return self.get(batch_id, observe=False)

    def fail(self, batch_id: str, code: str, message: str) -> Batch:
        """A batch that cannot run at all (an empty file, a full queue): `failed`, its jobs swept."""
        errors = BatchErrors(data=[BatchErrorItem(code=code, message=message)])
        self.connection.hset(keys.batch_key(batch_id), "errors", errors.model_dump_json())
        self._end(batch_id, "failed")
        return self.get(batch_id, observe=False)

    # ----- read -----
    def get(self, batch_id: str, owner: str | None = None, observe: bool = True) -> Batch:
        """The batch; a batch past its window is expired here first (`observe`). Another owner's is not found."""
        try:
            raw = self.connection.hgetall(keys.batch_key(batch_id))
        except ValueError:
            raw = None
        if not raw:
            raise BatchNotFound(f"no batch {batch_id} (never created, or past its retention)")
        batch = Batch.from_hash(raw)
        if owner is not None and batch.owner != owner:
            raise BatchNotFound(f"no batch {batch_id} (never created, or past its retention)")
        if observe and self._needs_sweep(batch, raw):
            if batch.status in ACTIVE:
                self._end(batch_id, "expired")
            else:
                self._sweep(batch_id, "cancelled" if batch.status == "cancelling" else batch.status)
            return self.get(batch_id, owner, observe=False)
        return batch

    def list(self, owner: str | None = None, after: str | None = None, limit: int = 20) -> list[Batch]:
        """Batches, newest first (OpenAI's order); `after` is the id of the last batch of the previous page."""
        index = keys.batch_owner_index(owner) if owner is not None else keys.BATCH_INDEX
        start = 0
        if after is not None:
            rank = self.connection.zrevrank(index, after)
            if rank is None:
                raise BatchNotFound(f"no batch {after} to list after")
            start = rank + 1
        found: list[Batch] = []
        while len(found) < limit:
            ids = [_text(i) for i in self.connection.zrevrange(index, start, start + limit - 1)]
            if not ids:
                break
            start += len(ids)
            gone = []
            for batch_id in ids:
                try:
                    found.append(self.get(batch_id))
                except BatchNotFound:
                    gone.append(batch_id)
            if gone:  # past their retention: drop them from the index
                start -= len(gone)
                self.connection.zrem(index, *gone)
        return found[:limit]

    def lines(self, batch: Batch, errors: bool = False) -> Iterator[str]:
        """The output file (or the error file) so far, one JSON line each, in input order."""
        kind = ERROR_KIND if errors else OUTPUT_KIND
        key = keys.batch_lines_key(batch.id)
        total = batch.request_counts.total
        for start in range(0, total, CHUNK):
            for value in self.connection.hmget(key, list(range(start, min(start + CHUNK, total)))):
                if value is not None and value[:1].decode() == kind:
                    yield value[1:].decode() + "\n"

    # ----- cancel and expire -----
    def cancel(self, batch_id: str, owner: str | None = None) -> Batch:
        """Cancel the batch's queued jobs and stop its running ones; what finished stays downloadable."""
        batch = self.get(batch_id, owner)
        if batch.status in ACTIVE:
            ended = scripts.run(self.connection, scripts.END, [keys.batch_key(batch_id)],
                          ["cancelling", "cancelling_at", time.time()])
            if ended:
                self._sweep(batch_id, "cancelled")
        return self.get(batch_id, owner, observe=False)

    def _end(self, batch_id: str, status: str) -> None:
        """Move an active batch to `status` (expired, failed) and sweep its jobs."""
        moved = scripts.run(self.connection, scripts.END, [keys.batch_key(batch_id)],
                            [status, f"{status}_at", time.time()])
        if moved:
            self._sweep(batch_id, status)

    def _needs_sweep(self, batch: Batch, raw: dict) -> bool:
        if batch.status in ACTIVE:
            return batch.status == "in_progress" and time.time() >= float(_text(raw.get(b"expires_at", raw.get("expires_at"))))
        # A sweep that did not finish (its process died): the next reader finishes it.
        return batch.status in ("cancelling", "expired", "failed") and not raw.get(b"swept", raw.get("swept"))

    def _sweep(self, batch_id: str, ended_as: str) -> None:
        """Take the batch's queued jobs out, give every index without a line an error line, stop the rest."""
        code, message = SWEEPS.get(ended_as, ("batch_failed", "The batch failed before this request ran."))
        raw = self.connection.hmget(keys.batch_key(batch_id), "queues", "total")
        rq_queues = [q for q in _text(raw[0] or b"").split(",") if q]
        total = int(raw[1] or 0)
        prefix = keys.batch_job_prefix(batch_id)
        queues = [Queue(name, connection=self.connection, serializer=JSONSerializer) for name in rq_queues]
        for queue in queues:
            taken = scripts.run(self.connection, scripts.TAKE_PREFIXED, [queue.key], [prefix])
            for start in range(0, len(taken), CHUNK):
                with self.connection.pipeline(transaction=False) as pipe:
                    for job_id in taken[start:start + CHUNK]:
                        job = Job(_text(job_id), connection=self.connection, serializer=JSONSerializer)
                        job.set_status(JobStatus.CANCELED, pipeline=pipe)
                        queue.canceled_job_registry.add(job, pipeline=pipe)
                    pipe.execute()
        ids_key = keys.batch_custom_ids_key(batch_id)
        now = time.time()
        for start in range(0, total, CHUNK):
            custom_ids = [json.loads(c) for c in self.connection.lrange(ids_key, start, start + CHUNK - 1)]
            with self.connection.pipeline(transaction=False) as pipe:
                for index, custom_id in enumerate(custom_ids, start):
                    self._write_line(pipe, batch_id, index, custom_id, code, message, ended_as, now)
                pipe.execute()
        self._stop_running(queues, prefix)
        scripts.run(self.connection, scripts.SETTLE_ONLY, [keys.batch_key(batch_id)], [time.time()])

    def _stop_running(self, queues: list[Queue], prefix: str) -> None:
        """Cancel each job of the batch that a worker holds: its cancel is recorded, so it wins even where no
        worker hears RQ's stop-job command (a worker that just took the job, or died meanwhile), and the
        command stops a running one within a step."""
        with self.connection.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.lrange(queue.intermediate_queue_key, 0, -1)
            held = {_text(j) for ids in pipe.execute() for j in ids if _text(j).startswith(prefix)}
        running = {job_id for queue in queues for job_id in queue.started_job_registry.get_job_ids(cleanup=False)
                   if job_id.startswith(prefix)}
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id in held | running:
                pipe.set(keys.cancel_key(job_id), 1, ex=keys.CANCEL_TTL_S)
            pipe.execute()
        for job_id in running:
            with contextlib.suppress(InvalidJobOperation, NoSuchJobError):  # it ended meanwhile
                send_stop_job_command(self.connection, job_id, serializer=JSONSerializer)

    def _write_line(self, pipe, batch_id: str, index: int, custom_id: str | None, code: str, message: str,
                    status: str, now: float) -> None:
        job_id = keys.batch_job_id(batch_id, index)
        line = ERROR_KIND + json.dumps(error_line(custom_id, message, code, request_id=job_id))
        base = self._base_queue(batch_id)
        batch_keys = [keys.batch_key(batch_id), keys.batch_lines_key(batch_id), keys.batch_feed_key(batch_id),
                      keys.queue_feed_key(base)]
        scripts.run(pipe, scripts.RECORD, batch_keys,
                    [index, "failed", line, "", now, FEED_MAXLEN, job_id, status, custom_id or "", batch_id, base, ""])

    def _base_queue(self, batch_id: str) -> str:
        """The base queue a batch was created on (it never changes: read once per store)."""
        if batch_id not in self._bases:
            self._bases[batch_id] = _text(self.connection.hget(keys.batch_key(batch_id), "queue"))
        return self._bases[batch_id]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
