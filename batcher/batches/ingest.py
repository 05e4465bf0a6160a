"""A batch file becomes a batch: its lines read as a stream, validated, and enqueued in chunks.

A bad line does not stop the batch: it counts as a failed request, with its reason in the error file. A file
with no valid line at all (or none) makes a `failed` batch, as OpenAI's validation does. Each job carries the
batch's deadline, so no worker starts it after the completion window.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable
from datetime import datetime, timezone

from rqbatcher.batches.batch_object import (
    DEFAULT_BATCH_RETENTION_S,
    DEFAULT_COMPLETION_WINDOW,
    Batch,
    outlasting_retention,
)
from rqbatcher.batches.store import BatchStore
from rqbatcher.jobs import keys
from rqbatcher.jobs.enqueue import Enqueuer, QueueFull
from rqbatcher.openai.batch_endpoints import ENDPOINTS, parse_line
from rqbatcher.openai.batch_lines import BatchLineError
from rqbatcher.openai.generation_body import CHAT_URL
from rqbatcher.schema import BatchItem, GenerationRequest
from rqbatcher.service_class import BATCH

BATCH_CHUNK = 1000  # batch lines per enqueue pipeline: a big file never sits in memory whole
QUEUE_TTL_MARGIN_S = 60  # a batch's jobs may wait in their queue until the window ends, and a little more

Line = tuple[int, str | None, GenerationRequest | None, str | None]  # (index, custom_id, request, error reason)


def create_batch(enqueuer: Enqueuer, lines: Iterable[str | bytes], *, endpoint: str | None = None,
                 completion_window: str = DEFAULT_COMPLETION_WINDOW, metadata: dict[str, str] | None = None,
                 owner: str | None = None, input_file_id: str | None = None, priority: int = 0,
                 retention_s: int = DEFAULT_BATCH_RETENTION_S, output_expires_s: int | None = None) -> Batch:
    """Create a batch from the lines of an OpenAI batch file on the enqueuer's queue; its output and error files
    live `output_expires_s` from its end (None: as long as the batch, `retention_s`).

    `endpoint` defaults to the url of the first line that has a valid one. Raise BatchInputError for a bad
    window or metadata, QueueFull when the queue fills (the batch then ends `failed`)."""
    lines = (line for line in lines if line.strip())
    head: list[str | bytes] = []
    if endpoint is None:
        for line in lines:
            head.append(line)
            endpoint = _line_url(line)
            if endpoint is not None:
                break
    store = BatchStore(enqueuer.connection)
    retention_s = outlasting_retention(retention_s, completion_window, output_expires_s)
    batch = store.begin(endpoint=endpoint or CHAT_URL, completion_window=completion_window, queue=enqueuer.queue,
                        metadata=metadata, owner=owner, input_file_id=input_file_id, retention_s=retention_s,
                        output_expires_s=output_expires_s)
    deadline = datetime.fromtimestamp(batch.expires_at, timezone.utc)
    queue_ttl = max(enqueuer.queue_ttl, batch.expires_at - batch.created_at + QUEUE_TTL_MARGIN_S)
    index, valid, first_error, models, rq_queues = 0, 0, None, set(), set()
    chunk: list[Line] = []
    for line in itertools.chain(head, lines):
        try:
            custom_id, request, item_fields = parse_line(_decoded(line), batch.endpoint)
            request = request.model_copy(update={
                "batch": BatchItem(id=batch.id, index=index, custom_id=custom_id, **item_fields),
                "deadline": deadline,
                "priority": priority, "service_class": BATCH, "tenant": owner})
            chunk.append((index, custom_id, request, None))
            models.add(request.model)
            valid += 1
        except BatchLineError as exc:
            chunk.append((index, exc.custom_id, None, f"line {index + 1}: {exc}"))
            first_error = first_error or chunk[-1][3]
        index += 1
        if len(chunk) == BATCH_CHUNK:
            if not _add_chunk(enqueuer, store, batch, chunk, rq_queues, queue_ttl, retention_s):
                break
            chunk = []
    else:
        if chunk:
            _add_chunk(enqueuer, store, batch, chunk, rq_queues, queue_ttl, retention_s)
    if len(models) == 1 and None not in models:
        enqueuer.connection.hset(keys.batch_key(batch.id), "model", models.pop())
    if index == 0:
        return store.fail(batch.id, "empty_file", "The input file has no requests.")
    if valid == 0:
        return store.fail(batch.id, "invalid_file", f"No line of the input file is a valid request ({first_error}).")
    return store.start(batch.id)


def _add_chunk(enqueuer: Enqueuer, store: BatchStore, batch: Batch, chunk: list[Line], rq_queues: set[str],
               queue_ttl: int, retention_s: int) -> bool:
    """Enqueue one chunk of a batch and store its lines' bookkeeping; False if the batch was cancelled."""
    requests = [request for _, _, request, _ in chunk if request is not None]
    prepared = [enqueuer.prepare(request, keys.batch_job_id(batch.id, request.batch.index), queue_ttl)
                for request in requests]
    adding = Counter(name for name, _ in prepared)
    try:
        enqueuer.check_room(adding)
    except QueueFull as exc:
        store.fail(batch.id, "queue_full", str(exc))
        raise QueueFull(f"batch {batch.id} failed: {exc}") from None
    rq_queues.update(adding)
    bad = {index: (custom_id, reason) for index, custom_id, _, reason in chunk if reason is not None}
    with enqueuer.connection.pipeline() as pipe:
        jobs = enqueuer.enqueue_on(pipe, requests, prepared)
        store.add_lines(pipe, batch.id, chunk[0][0], [custom_id for _, custom_id, _, _ in chunk], bad,
                        rq_queues, retention_s)
        pipe.hget(keys.batch_key(batch.id), "status")
        status = pipe.execute()[-1]
    enqueuer.confirm(jobs, f"the enqueue of {len(requests)} lines of batch {batch.id}")
    if status in (b"validating", "validating"):
        return True
    store.cancel(batch.id)  # cancelled while validating: sweep the jobs enqueued since
    return False


def _decoded(line: str | bytes) -> str:
    if isinstance(line, str):
        return line
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchLineError(None, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _line_url(line: str | bytes) -> str | None:
    """The url of a batch line, if it is one of the endpoints (the batch's endpoint when none was given)."""
    try:
        url = json.loads(line).get("url")
    except (ValueError, AttributeError):
        return None
    return url if url in ENDPOINTS else None
