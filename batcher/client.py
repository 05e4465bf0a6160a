"""Client: enqueue generation jobs on Redis, follow their token streams, and read their results.

Jobs are plain RQ jobs (`batcher.jobs.generate`, JSON serializer), so rq's own tools see them too.
No torch here: a backend needs only `pip install batcher`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

from redis import Redis
from rq import Queue
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from batcher import keys
from batcher.admin import list_workers
from batcher.batches import (DEFAULT_BATCH_RETENTION_S, DEFAULT_COMPLETION_WINDOW, Batch, BatchInputError,
                             BatchNotFound, BatchStore, record_job_end)
from batcher.errors import BatcherError
from batcher.feed import DEFAULT_CLAIM_IDLE_S, Completion, follow
from batcher.job_stream import AttemptFilter, append_event
from batcher.jobs import JOB_FUNCTION, job_argument, request_of
from batcher.openai_batch import CHAT_URL, ENDPOINTS, BatchLineError, parse_batch_line
from batcher.redis_retry import retry_while_unreachable
from batcher.schema import (BatchItem, ChatMessage, GenerationRequest, GenerationResult, SamplingParams,
                            StreamEvent)
from batcher.service_class import BATCH, INTERACTIVE, class_of, class_queue, parse_queue

__all__ = ["Client", "connect", "JobFailed", "JobNotFound", "QueueFull", "JobInfo", "Batch", "BatchNotFound",
           "BatchInputError", "Completion"]

REDIS_URL_ENV = "BATCHER_REDIS_URL"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_RESULT_TTL_S = 24 * 3600  # how long a result (and its stream) stays readable
DEFAULT_FAILURE_TTL_S = 7 * 24 * 3600  # how long a failure stays in the FailedJobRegistry
DEFAULT_QUEUE_TTL_S = 24 * 3600  # the longest a job may wait in the queue before RQ drops it
DEFAULT_MAX_QUEUE_LENGTH = 100_000  # refuse to enqueue beyond this many waiting jobs in one queue
DEFAULT_SUMMARY_INSTRUCTIONS = "Summarise the following document in a few sentences."
DEFAULT_SUMMARY_MAX_TOKENS = 256
POLL_S = 1.0  # how long one blocking read waits before the job's status is checked again
DESCRIPTION_CHARS = 60
BATCH_CHUNK = 1000  # batch lines per enqueue pipeline: a big file never sits in memory whole

TERMINAL_STATUSES = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED)


class JobFailed(BatcherError, RuntimeError):
    """The job ended without a result: failed, stopped or cancelled. `reason` says why."""

    def __init__(self, job_id: str, status: str, reason: str) -> None:
        super().__init__(f"job {job_id} {status}: {reason}")
        self.job_id, self.status, self.reason = job_id, status, reason


class JobNotFound(BatcherError, LookupError):
    """No such job: never enqueued, or expired (result TTL, failure TTL or queue TTL)."""


class QueueFull(BatcherError, RuntimeError):
    """Backpressure: the queue holds more jobs than the client's `max_queue_length`."""


@dataclass(frozen=True)
class JobInfo:
    """What `status` reports. `position` is set while queued; `error` once failed or stopped."""

    id: str
    status: str
    queue: str
    position: int | None
    worker: str | None
    enqueued_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    error: str | None


def connect(redis_url: str | None = None) -> Redis:
    """A Redis client for `redis_url`, else $BATCHER_REDIS_URL, else localhost (rediss:// and passwords work)."""
    return Redis.from_url(redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL)


class Client:
    """Producer and consumer side of the jobs of one queue (`queue`; its priority levels are `queue.pN`, and its
    service classes have queues of their own: batcher/service_class.py)."""

    def __init__(
        self,
        redis: str | Redis | None = None,
        *,
        queue: str = keys.DEFAULT_QUEUE,
        result_ttl: int = DEFAULT_RESULT_TTL_S,
        failure_ttl: int = DEFAULT_FAILURE_TTL_S,
        queue_ttl: int = DEFAULT_QUEUE_TTL_S,
        max_queue_length: int | None = DEFAULT_MAX_QUEUE_LENGTH,
    ) -> None:
        self.connection = redis if isinstance(redis, Redis) else connect(redis)
        self.queue = keys.check_queue(queue)
        self.result_ttl, self.failure_ttl, self.queue_ttl = result_ttl, failure_ttl, queue_ttl
        self.max_queue_length = max_queue_length
        self._queues: dict[str, Queue] = {}

    # ----- enqueue -----
    def submit(self, request: GenerationRequest | str | dict, *, job_id: str | None = None) -> str:
        """Enqueue one request (a GenerationRequest, its dict, or a bare prompt); return the job id."""
        return self.submit_many([request], job_ids=None if job_id is None else [job_id])[0]

    def submit_many(self, requests: Iterable[GenerationRequest | str | dict],
                    job_ids: list[str] | None = None) -> list[str]:
        """Enqueue many requests in one pipeline; return their job ids in order.

        A request that names a `model` goes to that model's queue, which only workers serving the model
        poll; one without runs on any worker of the queue."""
        requests = [_as_request(r) for r in requests]
        if job_ids is not None and len(job_ids) != len(requests):
            raise ValueError(f"got {len(job_ids)} job ids for {len(requests)} requests")
        prepared = [self._prepare(request, None if job_ids is None else keys.check_job_id(job_ids[i]), self.queue_ttl)
                    for i, request in enumerate(requests)]
        self._check_room(Counter(name for name, _ in prepared))
        with self.connection.pipeline() as pipe:
            jobs = self._enqueue(pipe, requests, prepared)
            pipe.execute()
        return [job.id for job in jobs]

    def _prepare(self, request: GenerationRequest, job_id: str | None, queue_ttl: int):
        """(the RQ queue, RQ's enqueue data) of one request."""
        base = self.queue if request.model is None else keys.model_queue(self.queue, request.model)
        return class_queue(base, class_of(request), request.priority, request.tenant), Queue.prepare_data(
            JOB_FUNCTION,
            args=(job_argument(request),),
            description=_description(request),
            job_id=job_id,
            result_ttl=self.result_ttl,
            failure_ttl=self.failure_ttl,
            ttl=queue_ttl,
        )

    def _enqueue(self, pipe, requests: list[GenerationRequest], prepared: list) -> list[Job]:
        """Queue the jobs on `pipe`, and name each model queue they use (for `batcher queues`)."""
        models = {keys.model_queue(self.queue, r.model): r.model for r in requests if r.model is not None}
        if models:
            pipe.hset(keys.MODEL_QUEUES, mapping=models)
        classed = {name for name, _ in prepared if parse_queue(name).service_class != INTERACTIVE}
        if classed:
            pipe.sadd(keys.class_queues_key(self.queue), *classed)
        return [self._rq_queue(name).enqueue_many([data], pipeline=pipe)[0] for name, data in prepared]

    def summarise(self, document: str, instructions: str | None = None, *, sampling: SamplingParams | None = None,
                  job_id: str | None = None, **request_fields) -> str:
        """Enqueue a chat request that asks the model to summarise `document`; return the job id."""
        content = f"{instructions or DEFAULT_SUMMARY_INSTRUCTIONS}\n\n{document}"
        request = GenerationRequest(messages=[ChatMessage(role="user", content=content)],
                                    sampling=sampling or SamplingParams(max_tokens=DEFAULT_SUMMARY_MAX_TOKENS),
                                    **request_fields)
        return self.submit(request, job_id=job_id)

    # ----- follow -----
    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Yield the job's events from the start until `done` or `error` (blocking reads).

        After a `restart`, only events of the restart's execution are yielded, so a reader never mixes
        the text of a lost attempt with the new one. A job that ends without a terminal event (one that
        expired while queued) ends the stream with one inferred from its status. Redis outages after the
        start are waited out."""
        key = keys.stream_key(job_id)
        self.connection.ping()  # Redis unreachable from the start is an error at once; later outages are waited out
        deadline = None if timeout is None else time.monotonic() + timeout
        last_id, attempts = "0-0", AttemptFilter()
        while True:
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"job {job_id}: no end of stream within {timeout} s")
            reply = retry_while_unreachable(self.connection.xread, {key: last_id}, block=max(1, int(wait * 1000)),
                                            deadline=deadline)
            if not reply:
                end = retry_while_unreachable(self.inferred_end, job_id, deadline=deadline)
                if end is not None and not retry_while_unreachable(self.connection.xread, {key: last_id}, deadline=deadline):
                    yield end
                    return
                continue
            for entry_id, fields in reply[0][1]:
                last_id = entry_id
                event = StreamEvent.from_fields(fields)
                if not attempts.accepts(event):
                    continue  # a lost attempt that is still writing
                yield event
                if event.terminal:
                    return

    def result(self, job_id: str, timeout: float | None = None) -> GenerationResult:
        """Wait for the job's result. Raise JobFailed (with the reason), JobNotFound, or TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self._fetch(job_id)  # an unknown job, or Redis unreachable from the start, is an error at once
        while True:
            result = retry_while_unreachable(self._wait_for_result, job, deadline, timeout, deadline=deadline)
            if result is not None:
                return result

    def _wait_for_result(self, job: Job, deadline: float | None, timeout: float | None) -> GenerationResult | None:
        """The result if the job has ended, else None after one blocking read of its results stream."""
        results_key = Result.get_key(job.id)
        newest = self.connection.xrevrange(results_key, count=1)  # read before the status: no lost wake-up
        status = self._status(job)
        if status in TERMINAL_STATUSES:
            return self._ended(job, status)
        wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError(f"job {job.id} is still {status.value} after {timeout} s")
        self.connection.xread({results_key: newest[0][0] if newest else "0-0"}, block=max(1, int(wait * 1000)))
        return None

    # ----- control -----
    def cancel(self, job_id: str) -> bool:
        """Cancel a job: a queued one never runs, a running one stops within one step (its partial text stays in
        its stream), and one whose worker was lost is not started again. False if the job had already ended.

        The cancel is recorded in Redis first (`keys.cancel_key`), so it wins even where no worker hears RQ's
        stop-job command: a worker checks it when it starts the job, each time it renews the job's lease, and
        when it recovers the job of a lost worker."""
        job = self._fetch(job_id)
        if self._status(job) in TERMINAL_STATUSES:
            return False
        self.connection.set(keys.cancel_key(job.id), 1, ex=keys.CANCEL_TTL_S)
        if self._rq_queue(job.origin).remove(job.id):  # atomic: no worker can take it any more
            job.cancel()
            with self.connection.pipeline() as pipe:
                failure_ttl = job.failure_ttl if job.failure_ttl is not None else self.failure_ttl
                append_event(pipe, job.id, StreamEvent(type="done", finish_reason="cancelled"), failure_ttl)
                record_job_end(pipe, job_id=job.id, queue=job.origin, status="stopped", request=request_of(job),
                               reason="cancelled while queued")
                pipe.delete(keys.cancel_key(job.id))
                pipe.execute()
            return True
        status = self._status(job)
        if status == JobStatus.STARTED:
            with contextlib.suppress(InvalidJobOperation):  # the fast path; the recorded cancel is the sure one
                send_stop_job_command(self.connection, job.id, serializer=JSONSerializer)
        elif status in (JobStatus.DEFERRED, JobStatus.SCHEDULED):  # not in a queue list: RQ cancels it
            job.cancel()
        return True

    def status(self, job_id: str) -> JobInfo:
        job = self._fetch(job_id)
        status = self._status(job)
        error = None
        if status in (JobStatus.FAILED, JobStatus.STOPPED):
            latest = job.latest_result()
            error = latest.exc_string if latest is not None else None
        return JobInfo(
            id=job.id,
            status=status.value,
            queue=job.origin,
            position=job.get_position() if status == JobStatus.QUEUED else None,
            worker=job.worker_name,
            enqueued_at=job.enqueued_at,
            started_at=job.started_at,
            ended_at=job.ended_at,
            error=error,
        )

    # ----- batches -----
    def create_batch(self, lines: Iterable[str | bytes], *, endpoint: str | None = None,
                     completion_window: str = DEFAULT_COMPLETION_WINDOW, metadata: dict[str, str] | None = None,
                     owner: str | None = None, input_file_id: str | None = None, priority: int = 0,
                     retention_s: int = DEFAULT_BATCH_RETENTION_S) -> Batch:
        """Create a batch from the lines of an OpenAI batch file, read as a stream and enqueued in chunks.

        `endpoint` defaults to the url of the first line that has a valid one. A bad line does not stop
        the batch: it counts as a failed request, with its reason in the error file; a file with no valid line at all
        (or none) makes a `failed` batch, as OpenAI's validation does. Each job carries the
        batch's deadline, so no worker starts it after the completion window. Raise BatchInputError for a
        bad window or metadata, QueueFull when the queue fills (the batch then ends `failed`)."""
        lines = (line for line in lines if line.strip())
        head: list[str | bytes] = []
        if endpoint is None:
            for line in lines:
                head.append(line)
                endpoint = _line_url(line)
                if endpoint is not None:
                    break
        store = BatchStore(self.connection)
        batch = store.begin(endpoint=endpoint or CHAT_URL, completion_window=completion_window, queue=self.queue,
                            metadata=metadata, owner=owner, input_file_id=input_file_id, retention_s=retention_s)
        deadline = datetime.fromtimestamp(batch.expires_at, timezone.utc)
        queue_ttl = max(self.queue_ttl, batch.expires_at - batch.created_at + 60)
        index, valid, first_error, models, rq_queues = 0, 0, None, set(), set()
        chunk: list[tuple[int, str | None, GenerationRequest | None, str | None]] = []
        for line in itertools.chain(head, lines):
            try:
                custom_id, request = parse_batch_line(_decoded(line), batch.endpoint)
                request = request.model_copy(update={
                    "batch": BatchItem(id=batch.id, index=index, custom_id=custom_id), "deadline": deadline,
                    "priority": priority, "service_class": BATCH, "tenant": owner})
                chunk.append((index, custom_id, request, None))
                models.add(request.model)
                valid += 1
            except BatchLineError as exc:
                chunk.append((index, exc.custom_id, None, f"line {index + 1}: {exc}"))
                first_error = first_error or chunk[-1][3]
            index += 1
            if len(chunk) == BATCH_CHUNK:
                if not self._add_batch_chunk(store, batch, chunk, rq_queues, queue_ttl, retention_s):
                    break
                chunk = []
        else:
            if chunk:
                self._add_batch_chunk(store, batch, chunk, rq_queues, queue_ttl, retention_s)
        if len(models) == 1 and None not in models:
            self.connection.hset(keys.batch_key(batch.id), "model", models.pop())
        if index == 0:
            return store.fail(batch.id, "empty_file", "The input file has no requests.")
        if valid == 0:
            return store.fail(batch.id, "invalid_file", f"No line of the input file is a valid request ({first_error}).")
        return store.start(batch.id)

    def _add_batch_chunk(self, store: BatchStore, batch: Batch, chunk: list, rq_queues: set[str], queue_ttl: int,
                         retention_s: int) -> bool:
        """Enqueue one chunk of a batch and store its lines' bookkeeping; False if the batch was cancelled."""
        requests = [request for _, _, request, _ in chunk if request is not None]
        prepared = [self._prepare(request, keys.batch_job_id(batch.id, request.batch.index), queue_ttl)
                    for request in requests]
        adding = Counter(name for name, _ in prepared)
        try:
            self._check_room(adding)
        except QueueFull as exc:
            store.fail(batch.id, "queue_full", str(exc))
            raise QueueFull(f"batch {batch.id} failed: {exc}") from None
        rq_queues.update(adding)
        bad = {index: (custom_id, reason) for index, custom_id, _, reason in chunk if reason is not None}
        with self.connection.pipeline() as pipe:
            self._enqueue(pipe, requests, prepared)
            store.add_lines(pipe, batch.id, chunk[0][0], [custom_id for _, custom_id, _, _ in chunk], bad,
                            rq_queues, retention_s)
            pipe.hget(keys.batch_key(batch.id), "status")
            status = pipe.execute()[-1]
        if status in (b"validating", "validating"):
            return True
        store.cancel(batch.id)  # cancelled while validating: sweep the jobs enqueued since
        return False

    def batch(self, batch_id: str, owner: str | None = None) -> Batch:
        """The batch, with its status and request counts. Raise BatchNotFound (also for another owner's)."""
        return BatchStore(self.connection).get(batch_id, owner)

    def batches(self, owner: str | None = None, after: str | None = None, limit: int = 20) -> list[Batch]:
        """Batches newest first (one owner's only, with `owner`); `after` pages on from a batch id."""
        return BatchStore(self.connection).list(owner, after, limit)

    def cancel_batch(self, batch_id: str, owner: str | None = None) -> Batch:
        """Cancel the batch's queued jobs and stop its running ones; finished results stay downloadable."""
        return BatchStore(self.connection).cancel(batch_id, owner)

    def batch_output(self, batch_id: str, errors: bool = False, owner: str | None = None) -> Iterator[str]:
        """The batch's output file (or error file) as JSON lines, in input order, as far as it has run."""
        store = BatchStore(self.connection)
        return store.lines(store.get(batch_id, owner), errors)  # a missing batch raises now, not at the first line

    # ----- the completion feed and the models -----
    def completions(self, group: str, consumer: str, *, batch_id: str | None = None,
                    claim_idle_s: float = DEFAULT_CLAIM_IDLE_S, timeout: float | None = None) -> Iterator[Completion]:
        """Every finished job of this client's queue (or of one batch), through a consumer group.

        Each entry goes to one consumer of `group` and is acknowledged when the loop asks for the next
        one; an entry a dead consumer held for `claim_idle_s` is delivered again to a live one. With
        `timeout`, the iteration ends once nothing arrives for that long."""
        if batch_id is not None:
            self.batch(batch_id)  # no consumer group (and no stream) for a batch that does not exist
        key = keys.batch_feed_key(batch_id) if batch_id is not None else keys.queue_feed_key(self.queue)
        return follow(self.connection, key, group, consumer, claim_idle_s=claim_idle_s, timeout=timeout)

    def models(self) -> list[str]:
        """The models that live workers serve."""
        return sorted({w.model for w in list_workers(self.connection)})

    # ----- helpers -----
    def _rq_queue(self, name: str) -> Queue:
        if name not in self._queues:
            self._queues[name] = Queue(name, connection=self.connection, serializer=JSONSerializer)
        return self._queues[name]

    def _check_room(self, adding: dict[str, int]) -> None:
        """Backpressure (a soft limit: producers racing each other may pass it by a few jobs)."""
        if self.max_queue_length is None:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for name in adding:
                pipe.llen(self._rq_queue(name).key)
            lengths = pipe.execute()
        for (name, n), length in zip(adding.items(), lengths):
            if length + n > self.max_queue_length:
                raise QueueFull(f"queue {name} holds {length} jobs; adding {n} would pass the limit of "
                                f"{self.max_queue_length}")

    def _fetch(self, job_id: str) -> Job:
        try:
            return Job.fetch(keys.check_job_id(job_id), connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            raise JobNotFound(f"no job {job_id} (never enqueued, or expired)") from None

    def _status(self, job: Job) -> JobStatus:
        try:
            return job.get_status(refresh=True)
        except InvalidJobOperation:
            raise JobNotFound(f"no job {job.id} (expired)") from None

    def _ended(self, job: Job, status: JobStatus) -> GenerationResult:
        if status == JobStatus.CANCELED:
            raise JobFailed(job.id, status.value, "cancelled while queued")
        latest = job.latest_result()
        if status == JobStatus.FINISHED and latest is not None and latest.type == Result.Type.SUCCESSFUL:
            return GenerationResult.model_validate(latest.return_value)
        reason = latest.exc_string if latest is not None and latest.exc_string else "no reason recorded"
        raise JobFailed(job.id, status.value, reason.strip())

    def inferred_end(self, job_id: str) -> StreamEvent | None:
        """The end of a stream whose job ended without writing one (it expired while queued, or is gone);
        None while the job may still write. A reader asks when its stream has been quiet for a while."""
        try:
            job = self._fetch(job_id)
            status = self._status(job)
        except JobNotFound as exc:
            return StreamEvent(type="error", error=str(exc))
        if status == JobStatus.CANCELED:
            return StreamEvent(type="done", finish_reason="cancelled")
        if status in (JobStatus.FAILED, JobStatus.STOPPED):
            try:
                self._ended(job, status)
            except JobFailed as exc:
                return StreamEvent(type="error", error=exc.reason)
        if status == JobStatus.FINISHED:
            result = self._ended(job, status)
            return StreamEvent(type="done", finish_reason=result.finish_reason, usage=result.usage)
        return None


def _as_request(request: GenerationRequest | str | dict) -> GenerationRequest:
    if isinstance(request, GenerationRequest):
        return request
    if isinstance(request, str):
        return GenerationRequest(prompt=request)
    return GenerationRequest.model_validate(request)


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


def _description(request: GenerationRequest) -> str:
    """A short description for rq info and dashboards (RQ's default repeats the whole prompt)."""
    if request.prompt is not None:
        head = request.prompt
    elif request.messages is not None:
        head = request.messages[-1].content
    else:
        head = f"{len(request.prompt_token_ids)} prompt tokens"
    head = " ".join(head.split())
    return f"generate: {head[:DESCRIPTION_CHARS]}{'...' if len(head) > DESCRIPTION_CHARS else ''}"

