"""Batches in Redis: create, read, list, cancel, expire (how a batch lives there: batcher/batches/__init__.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from redis import Redis

from rqbatcher.batches import scripts
from rqbatcher.batches.batch_object import (
    ACTIVE,
    DEFAULT_BATCH_RETENTION_S,
    Batch,
    BatchErrorItem,
    BatchErrors,
    BatchInputError,
    BatchNotFound,
    check_metadata,
    check_output_expiry,
    new_batch_id,
    parse_window,
)
from rqbatcher.batches.lines import CHUNK, EXPIRED_MESSAGE, rendered, write_error_line_on
from rqbatcher.jobs import keys
from rqbatcher.jobs.fairness import forget_on
from rqbatcher.jobs.life import cancel_held
from rqbatcher.jobs.redis_text import as_text
from rqbatcher.jobs.rq_adapter import Queue, cancel_taken_on, held_job_ids, rq_queue
from rqbatcher.openai.batch_endpoints import ENDPOINTS
from rqbatcher.webhooks.outbox import dispatch_after

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
              retention_s: int = DEFAULT_BATCH_RETENTION_S, batch_id: str | None = None,
              output_expires_s: int | None = None) -> Batch:
        """Store a new batch, `validating`, with no requests yet; its output and error files live
        `output_expires_s` from its end (None: as long as the batch)."""
        if endpoint not in ENDPOINTS:
            raise BatchInputError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
        window_s = parse_window(completion_window)
        if retention_s <= window_s:
            raise BatchInputError(f"the retention ({retention_s} s) must outlast the completion window ({window_s} s)")
        metadata = check_metadata(metadata)
        batch_id = keys.check_batch_id(batch_id or new_batch_id())
        now = time.time()  # expires_at is whole seconds, as the Batch object shows it and jobs carry it
        fields = {"id": batch_id, "endpoint": endpoint, "completion_window": completion_window,
                  "status": "validating", "created_at": now, "expires_at": int(now) + window_s,
                  "queue": keys.check_queue(queue), "total": 0, "completed": 0, "failed": 0, "queues": ""}
        for name, value in (("model", model), ("owner", owner and keys.check_owner(owner)),
                            ("output_expires_s", check_output_expiry(output_expires_s)),
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
        scripts.run(self.connection, scripts.START, _ending_keys(batch_id), [time.time()])
        dispatch_after(self.connection, "a batch transition")
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
            ids = [as_text(i) for i in self.connection.zrevrange(index, start, start + limit - 1)]
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
        return rendered(self.connection, batch, errors)

    # ----- cancel and expire -----
    def cancel(self, batch_id: str, owner: str | None = None) -> Batch:
        """Cancel the batch's queued jobs and stop its running ones; what finished stays downloadable."""
        batch = self.get(batch_id, owner)
        if batch.status in ACTIVE:
            ended = scripts.run(self.connection, scripts.END, _ending_keys(batch_id),
                                ["cancelling", "cancelling_at", time.time()])
            if ended:
                self._sweep(batch_id, "cancelled")
        return self.get(batch_id, owner, observe=False)

    def _end(self, batch_id: str, status: str) -> None:
        """Move an active batch to `status` (expired, failed) and sweep its jobs (the sweep dispatches the end's
        webhook event)."""
        moved = scripts.run(self.connection, scripts.END, _ending_keys(batch_id),
                            [status, f"{status}_at", time.time()])
        if moved:
            self._sweep(batch_id, status)

    def _needs_sweep(self, batch: Batch, raw: dict) -> bool:
        if batch.status in ACTIVE:
            return (batch.status == "in_progress"
                    and time.time() >= float(as_text(raw.get(b"expires_at", raw.get("expires_at")))))
        # A sweep that did not finish (its process died): the next reader finishes it.
        return batch.status in ("cancelling", "expired", "failed") and not raw.get(b"swept", raw.get("swept"))

    def _sweep(self, batch_id: str, ended_as: str) -> None:
        """Take the batch's queued jobs out, give every index without a line an error line, stop the rest."""
        code, message = SWEEPS.get(ended_as, ("batch_failed", "The batch failed before this request ran."))
        raw = self.connection.hmget(keys.batch_key(batch_id), "queues", "total")
        rq_queues = [q for q in as_text(raw[0] or b"").split(",") if q]
        total = int(raw[1] or 0)
        prefix = keys.batch_job_prefix(batch_id)
        queues = [rq_queue(name, self.connection) for name in rq_queues]
        for queue in queues:
            taken = [as_text(j) for j in scripts.run(self.connection, scripts.TAKE_PREFIXED, [queue.key], [prefix])]
            for start in range(0, len(taken), CHUNK):
                with self.connection.pipeline(transaction=False) as pipe:
                    cancel_taken_on(pipe, queue, taken[start:start + CHUNK])
                    forget_on(pipe, queue.name, taken[start:start + CHUNK])
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
        scripts.run(self.connection, scripts.SETTLE_ONLY, _ending_keys(batch_id), [time.time()])
        dispatch_after(self.connection, "a batch transition")  # the event END or SETTLE_ONLY pushed

    def _stop_running(self, queues: list[Queue], prefix: str) -> None:
        """Cancel each job of the batch that a worker holds (taken or started): it stops within a step."""
        taken, started = held_job_ids(self.connection, queues, prefix)
        cancel_held(self.connection, taken | started, running=started)

    def _write_line(self, pipe, batch_id: str, index: int, custom_id: str | None, code: str, message: str,
                    status: str, now: float) -> None:
        write_error_line_on(pipe, batch_id=batch_id, base_queue=self._base_queue(batch_id), index=index,
                            custom_id=custom_id, code=code, message=message, status=status, now=now)

    def _base_queue(self, batch_id: str) -> str:
        """The base queue a batch was created on (it never changes: read once per store)."""
        if batch_id not in self._bases:
            self._bases[batch_id] = as_text(self.connection.hget(keys.batch_key(batch_id), "queue"))
        return self._bases[batch_id]


def _ending_keys(batch_id: str) -> list[str]:
    """The keys of a script that may end a batch: the batch, its lines (the files whose expiry starts at the end)
    and the webhook outbox (where the end is announced)."""
    return [keys.batch_key(batch_id), keys.batch_lines_key(batch_id), keys.WEBHOOK_OUTBOX]
