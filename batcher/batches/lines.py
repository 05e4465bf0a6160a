"""A batch's lines: each request's outcome, written once by one script, and the output and error files
rendered from them in input order.

Every job end reports here (`record_outcome_on`, passed to `rqbatcher.jobs.ends.record_end`): a batch job's
output or error line and its counts, and, for every job, its completion-feed entries. A sweep (cancel, expiry)
gives the lines no job will write an error line (`write_error_line_on`). The script writes a line with HSETNX
and counts it only if it was new, so whoever records an index first wins, and a repeated or late write changes
nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from redis import Redis

from rqbatcher.batches import scripts
from rqbatcher.batches.batch_object import Batch
from rqbatcher.jobs import keys
from rqbatcher.openai.batch_endpoints import output_line
from rqbatcher.openai.batch_lines import error_line
from rqbatcher.schema import GenerationRequest, GenerationResult

FEED_MAXLEN = 100_000  # entries kept per feed stream (trimmed approximately)
CHUNK = 1000  # lines per pipeline when creating, sweeping or rendering a batch
OUTPUT_KIND, ERROR_KIND = "o", "e"  # the first character of a stored line says which file it goes to
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
FEED_FIELDS = ("job_id", "status", "custom_id", "batch_id", "queue", "finish_reason")
NO_USAGE = (0, 0, 0)  # (input, cached input, output) tokens of a line that counts none


def record_outcome_on(pipe, *, job_id: str, queue: str, status: str, request: GenerationRequest | None,
                      result: GenerationResult | None = None, reason: str | None = None,
                      now: float | None = None) -> None:
    """Queue on `pipe` (the transaction that records the job's end) its batch line and counts, and its
    completion-feed entries.

    `status` is how the job ended: finished (with `result`), failed (with `reason`) or stopped (with the
    partial `result`); `queue` is its RQ queue; `request` is what it carried (None if nothing readable)."""
    now = time.time() if now is None else now
    item = request.batch if request is not None else None
    if item is not None and job_id != keys.batch_job_id(item.id, item.index):
        item = None  # a batch's jobs are created by create_batch with derived ids: any other job is no part of it
    finish_reason = result.finish_reason if result is not None else ""
    base = keys.base_queue(queue)
    entry = (job_id, status, "" if item is None else item.custom_id or "", "" if item is None else item.id,
             base, finish_reason or "")
    if item is None:
        pipe.xadd(keys.queue_feed_key(base), dict(zip(FEED_FIELDS, entry)), maxlen=FEED_MAXLEN, approximate=True)
        return
    if status == "finished":
        kind, line = "completed", OUTPUT_KIND + json.dumps(
            output_line(item.custom_id, result, request, job_id=job_id, created=int(now)))
        usage = (result.usage.prompt_tokens, result.usage.cached_tokens, result.usage.completion_tokens)
    else:  # no usage: the batch's usage is that of its output lines, the requests OpenAI bills
        usage = NO_USAGE
        message = reason or "stopped before it finished"
        kind, line = "failed", ERROR_KIND + json.dumps(
            error_line(item.custom_id, message, "cancelled" if status == "stopped" else "generation_failed",
                       request_id=job_id))
    expired = ERROR_KIND + json.dumps(error_line(item.custom_id, EXPIRED_MESSAGE, "batch_expired",
                                                 request_id=job_id)) if kind == "failed" else ""
    scripts.run(pipe, scripts.RECORD, _record_keys(item.id, base),
                [item.index, kind, line, expired, now, FEED_MAXLEN, *entry, *usage])


def write_error_line_on(pipe, *, batch_id: str, base_queue: str, index: int, custom_id: str | None, code: str,
                        message: str, status: str, now: float) -> None:
    """Queue an error line for line `index`, unless it has one already (a bad input line, a swept job)."""
    job_id = keys.batch_job_id(batch_id, index)
    line = ERROR_KIND + json.dumps(error_line(custom_id, message, code, request_id=job_id))
    scripts.run(pipe, scripts.RECORD, _record_keys(batch_id, base_queue),
                [index, "failed", line, "", now, FEED_MAXLEN, job_id, status, custom_id or "", batch_id, base_queue,
                 "", *NO_USAGE])


def rendered(connection: Redis, batch: Batch, errors: bool = False) -> Iterator[str]:
    """The output file (or the error file) so far, one JSON line each, in input order."""
    kind = ERROR_KIND if errors else OUTPUT_KIND
    key = keys.batch_lines_key(batch.id)
    total = batch.request_counts.total
    for start in range(0, total, CHUNK):
        for value in connection.hmget(key, list(range(start, min(start + CHUNK, total)))):
            if value is not None and value[:1].decode() == kind:
                yield value[1:].decode() + "\n"


def _record_keys(batch_id: str, base_queue: str) -> list[str]:
    return [keys.batch_key(batch_id), keys.batch_lines_key(batch_id), keys.batch_feed_key(batch_id),
            keys.queue_feed_key(base_queue), keys.WEBHOOK_OUTBOX]
