"""Client: enqueue generation jobs on Redis, follow their token streams, and read their results.

Jobs are plain RQ jobs (`rqbatcher.jobs.generate`, JSON serializer), so rq's own tools see them too.
No torch here: a backend needs only `pip install rqbatcher`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from redis import Redis
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from rqbatcher.batches import ingest
from rqbatcher.batches.batch_object import (
    DEFAULT_BATCH_RETENTION_S,
    DEFAULT_COMPLETION_WINDOW,
    Batch,
    BatchInputError,
    BatchNotFound,
)
from rqbatcher.batches.lines import record_outcome_on
from rqbatcher.batches.store import BatchStore
from rqbatcher.errors import BatcherError
from rqbatcher.jobs import connection as redis_connection
from rqbatcher.jobs import durability, keys
from rqbatcher.jobs import life as job_life
from rqbatcher.jobs.admin import list_workers
from rqbatcher.jobs.ends import TERMINAL_STATUSES
from rqbatcher.jobs.enqueue import (
    DEFAULT_FAILURE_TTL_S,
    DEFAULT_MAX_QUEUE_LENGTH,
    DEFAULT_QUEUE_TTL_S,
    DEFAULT_RESULT_TTL_S,
    Enqueuer,
    QueueFull,
    as_request,
)
from rqbatcher.jobs.feed import DEFAULT_CLAIM_IDLE_S, Completion, follow
from rqbatcher.jobs.redis_retry import retry_while_unreachable
from rqbatcher.jobs.stream import Read, read_events
from rqbatcher.schema import ChatMessage, GenerationRequest, GenerationResult, SamplingParams, StreamEvent
from rqbatcher.webhooks.outbox import dispatch_after

__all__ = ["Client", "connect", "JobFailed", "JobNotFound", "QueueFull", "JobInfo", "Batch", "BatchNotFound",
           "BatchInputError", "Completion", "DEFAULT_MAX_QUEUE_LENGTH"]

REDIS_URL_ENV = "BATCHER_REDIS_URL"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_SUMMARY_INSTRUCTIONS = "Summarise the following document in a few sentences."
DEFAULT_SUMMARY_MAX_TOKENS = 256
POLL_S = 1.0  # how long one blocking read waits before the job's status is checked again

T = TypeVar("T")  # what a Redis call passed to `_first_call` returns


class JobFailed(BatcherError, RuntimeError):
    """The job ended without a result: failed, stopped or cancelled. `reason` says why."""

    def __init__(self, job_id: str, status: str, reason: str) -> None:
        super().__init__(f"job {job_id} {status}: {reason}")
        self.job_id, self.status, self.reason = job_id, status, reason


class JobNotFound(BatcherError, LookupError):
    """No such job: never enqueued, or expired (result TTL, failure TTL or queue TTL)."""


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
    user: str | None = None  # the request's own, as OpenAI's `user`
    metadata: dict | None = None  # the request's own (OpenAI's `metadata`), None when it has none


def connect(redis_url: str | None = None) -> Redis:
    """A Redis client for `redis_url`, else $BATCHER_REDIS_URL, else localhost (every form of
    rqbatcher.jobs.connection)."""
    return redis_connection.connect(redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL)


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
        replica_wait: durability.ReplicaWait | None = None,
    ) -> None:
        self.connection = redis if isinstance(redis, Redis) else connect(redis)
        self.enqueuer = Enqueuer(self.connection, keys.check_queue(queue), result_ttl, failure_ttl, queue_ttl,
                                 max_queue_length, replica_wait)
        self.queue = self.enqueuer.queue
        # Set once Redis has answered this client (a submit, a job fetched or found missing, a ping): from then on
        # a wait waits out an outage at its start too
        self._reached = False

    # ----- enqueue -----
    def submit(self, request: GenerationRequest | str | dict, *, job_id: str | None = None) -> str:
        """Enqueue one request (a GenerationRequest, its dict, or a bare prompt); return the job id."""
        return self.submit_many([request], job_ids=None if job_id is None else [job_id])[0]

    def submit_many(self, requests: Iterable[GenerationRequest | str | dict],
                    job_ids: list[str] | None = None) -> list[str]:
        """Enqueue many requests in one transaction; return their job ids in order. A request that names a
        `model` goes to that model's queue, which only workers serving the model poll."""
        job_ids = self.enqueuer.submit([as_request(r) for r in requests], job_ids)
        self._reached = True
        return job_ids

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

        A job rerun after a crash goes on where its stream stopped: its new execution's `start` and next tokens
        follow, and the text runs on. After the rare `restart` (a stream that could not be continued), only events
        of the restart's execution are yielded and the text starts over; a reader never mixes the text of a lost
        attempt with the new one. A job that ends without a terminal event (one that
        expired while queued) ends the stream with one inferred from its status. Redis outages after the
        start are waited out, and so is one at the start where this client has reached Redis before."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._first_call(self.connection.ping, deadline)

        def read(step: Read):
            if not step.block:
                return retry_while_unreachable(self.connection.xread, step.streams, deadline=deadline)
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"job {job_id}: no end of stream within {timeout} s")
            return retry_while_unreachable(self.connection.xread, step.streams, block=max(1, int(wait * 1000)),
                                           deadline=deadline)

        yield from read_events(job_id, read, lambda: retry_while_unreachable(self.inferred_end, job_id,
                                                                             deadline=deadline))

    def result(self, job_id: str, timeout: float | None = None) -> GenerationResult:
        """Wait for the job's result. Raise JobFailed (with the reason), JobNotFound, or TimeoutError.
        A Redis outage is waited out until `timeout`, except in a client that has never reached Redis."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self._first_call(self._fetch, deadline, job_id)  # an unknown job is an error at once
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
        its stream), and one whose worker was lost is not started again. False if the job had already ended."""
        job = self._fetch(job_id)
        cancelled = job_life.cancel(self.connection, job, self._status(job), record_outcome_on,
                                    self.enqueuer.replica_wait)
        if cancelled:  # a queued background response's end was announced on the webhook outbox
            dispatch_after(self.connection, f"the cancel of job {job_id}")
        return cancelled

    def status(self, job_id: str) -> JobInfo:
        job = self._fetch(job_id)
        status = self._status(job)
        error = None
        if status in (JobStatus.FAILED, JobStatus.STOPPED):
            latest = job.latest_result()
            error = latest.exc_string if latest is not None else None
        request = job_life.readable_request(job)
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
            user=request.user if request is not None else None,
            metadata=request.metadata or None if request is not None else None,
        )

    # ----- batches -----
    def create_batch(self, lines: Iterable[str | bytes], *, endpoint: str | None = None,
                     completion_window: str = DEFAULT_COMPLETION_WINDOW, metadata: dict[str, str] | None = None,
                     owner: str | None = None, input_file_id: str | None = None, priority: int = 0,
                     retention_s: int = DEFAULT_BATCH_RETENTION_S, output_expires_s: int | None = None) -> Batch:
        """Create a batch from the lines of an OpenAI batch file, read as a stream and enqueued in chunks
        (batcher/batches/ingest.py): a bad line becomes a failed request with its reason in the error file.
        Its output and error files live `output_expires_s` from its end (None: as long as the batch)."""
        return ingest.create_batch(self.enqueuer, lines, endpoint=endpoint, completion_window=completion_window,
                                   metadata=metadata, owner=owner, input_file_id=input_file_id, priority=priority,
                                   retention_s=retention_s, output_expires_s=output_expires_s)

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
    def _first_call(self, call: Callable[..., T], deadline: float | None, *args) -> T:
        """The first Redis call of a wait. Unreachable in a client that has never reached Redis, it is an error at
        once (most likely a wrong address); in one that has, an outage is waited out until `deadline`, as a
        client waiting on many jobs meets it between two of them."""
        if self._reached:
            return retry_while_unreachable(call, *args, deadline=deadline)
        answer = call(*args)
        self._reached = True
        return answer

    def _fetch(self, job_id: str) -> Job:
        try:
            job = Job.fetch(keys.check_job_id(job_id), connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            self._reached = True
            raise JobNotFound(f"no job {job_id} (never enqueued, or expired)") from None
        self._reached = True
        return job

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
