"""A job's life on Redis, in one place: what it carries, how its end is recorded, how it is cancelled.

A job ends in one of three hands, and each records the end with `record_end`, on the transaction it already
runs:
- the worker that ran it (finished, failed, or stopped by a cancel), in the transaction fenced by its lease;
  its own fenced stream writer has buffered the terminal stream event;
- the worker that recovered it after its worker was lost (cancelled meanwhile, or started too often);
- the client that cancelled it while it was still queued.
`record_end` queues RQ's side of the end (the Result and registries, or RQ's cancel for a job that never
started), the terminal stream event where the caller has no fenced writer, the batch line, counts and
completion-feed entries (`rqbatcher.batches.lines`), and a background response's webhook event (on the outbox).

A cancel is recorded in Redis (`keys.cancel_key`) before RQ's stop-job command is sent, so it wins even where
no worker hears the command: a worker checks it when it starts the job, each time it renews the job's lease,
and when it recovers the job of a lost worker.
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import ValidationError
from redis import Redis

from rqbatcher.batches.lines import record_outcome_on
from rqbatcher.jobs import durability, keys
from rqbatcher.jobs.contract import JOB_FUNCTION
from rqbatcher.jobs.fairness import forget_on
from rqbatcher.jobs.rq_adapter import (
    BaseJobWorker,
    DeserializationError,
    Execution,
    InvalidJobOperation,
    Job,
    JobStatus,
    Queue,
    cancel_taken_on,
    failure_ttl,
    rq_queue,
    stop_job,
)
from rqbatcher.jobs.stream import append_event
from rqbatcher.openai.batch_lines import readable
from rqbatcher.schema import GenerationRequest, GenerationResult, StreamEvent

# RQ's statuses of a job that has ended: nothing will run it again, and its end is recorded.
TERMINAL_STATUSES = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED)
CANCELLED_WHILE_QUEUED = "cancelled while queued"
PICKLED_JOB_REASON = (
    "the job data is not JSON; it was probably enqueued with RQ's default pickle serializer. Enqueue with "
    "serializer=rq.serializers.JSONSerializer (a batcher worker never unpickles job data)"
)

EndStatus = Literal["finished", "failed", "stopped"]
# How a background response's end is announced (its webhook event `response.<ending>`): a finished job that ran out
# of tokens or time is an incomplete response
INCOMPLETE_FINISH_REASONS = ("length", "timeout")
RESPONSE_ENDINGS = {"finished": "completed", "failed": "failed", "stopped": "cancelled"}


class InvalidJob(ValueError):
    """A job that can never run, with the reason why (it fails without retries)."""


# ----- what a job carries -----
def decode_request(job: Job) -> GenerationRequest:
    """The request an RQ job carries; raise InvalidJob with a readable reason if it carries none."""
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except DeserializationError:
        raise InvalidJob(PICKLED_JOB_REASON) from None
    if func_name != JOB_FUNCTION:
        raise InvalidJob(f"a batcher worker runs only {JOB_FUNCTION} jobs, not {func_name!r}")
    if kwargs or not isinstance(args, (list, tuple)) or len(args) != 1 or not isinstance(args[0], dict):
        raise InvalidJob(f"{JOB_FUNCTION} takes one positional argument, a GenerationRequest as a JSON object")
    try:
        return GenerationRequest.model_validate(args[0])
    except ValidationError as exc:
        raise InvalidJob(f"invalid request: {readable(exc)}") from None


def readable_request(job: Job) -> GenerationRequest | None:
    """The request a job carries, or None where it carries no readable one (its end is still recorded)."""
    try:
        return decode_request(job)
    except InvalidJob:
        return None


# ----- how a job ends -----
def terminal_event(status: EndStatus, result: GenerationResult | None = None, reason: str | None = None,
                   execution_id: str | None = None) -> StreamEvent:
    """The last event of a job's stream: `done` with the finish reason, usage and whole result, or `error` with
    the reason."""
    if status == "failed":
        return StreamEvent(type="error", execution_id=execution_id, error=reason)
    return StreamEvent(type="done", execution_id=execution_id,
                       finish_reason="cancelled" if result is None else result.finish_reason,
                       usage=None if result is None else result.usage, result=result)


def record_end(pipe, job: Job, queue: Queue, status: EndStatus, *, request: GenerationRequest | None,
               result: GenerationResult | None = None, reason: str | None = None,
               worker: BaseJobWorker | None = None, execution: Execution | None = None,
               stream_event: bool = True) -> None:
    """Queue on `pipe` (a transaction in MULTI) everything that records the end of `job`.

    `status`: finished (with `result`), failed (with `reason`) or stopped (cancelled; with the partial `result`
    where it ran). With `worker` and `execution`, RQ records it as that execution's end (Result, registries,
    worker counters); without, the job never started and RQ records a cancel. `stream_event=False` where the
    caller's fenced stream writer has the terminal event."""
    if worker is None:
        cancel_taken_on(pipe, queue, [job.id])
    elif status == "finished":
        worker.success_on(pipe, job, queue, execution, result.model_dump(mode="json"))
    else:
        worker.failure_on(pipe, job, queue, execution, reason, stopped=status == "stopped")
    if stream_event:
        ttl = worker.result_ttl(job) if status == "finished" else failure_ttl(job)
        append_event(pipe, job.id, terminal_event(status, result, reason), ttl)
    record_outcome_on(pipe, job_id=job.id, queue=queue.name, status=status, request=request, result=result,
                      reason=reason)
    if request is not None and request.background_response:
        announce_response_end_on(pipe, request, status, result)


def announce_response_end_on(pipe, request: GenerationRequest, status: EndStatus,
                             result: GenerationResult | None) -> None:
    """Push a background response's end onto the webhook outbox (batcher/webhooks), in the transaction that records
    it: announced once it happened, never lost."""
    ending = RESPONSE_ENDINGS[status]
    if status == "finished" and result is not None and result.finish_reason in INCOMPLETE_FINISH_REASONS:
        ending = "incomplete"
    pipe.rpush(keys.WEBHOOK_OUTBOX, json.dumps({"type": f"response.{ending}", "id": request.background_response,
                                                "tenant": request.tenant, "created_at": int(time.time())}))


# ----- cancel -----
def cancel(connection: Redis, job: Job, status: JobStatus, replica_wait: durability.ReplicaWait | None = None) -> bool:
    """Cancel a job (its current `status` just read): a queued one never runs, a running one stops within one
    step (its partial text stays in its stream), and one whose worker was lost is not started again. False if
    the job had already ended."""
    if status in TERMINAL_STATUSES:
        return False
    _record_cancels(connection, [job.id])  # first: from here on, no worker runs it, whatever happens next
    queue = rq_queue(job.origin, connection)
    if queue.remove(job.id):  # atomic: no worker can take it any more
        with connection.pipeline() as pipe:
            pipe.multi()
            record_end(pipe, job, queue, "stopped", request=readable_request(job), reason=CANCELLED_WHILE_QUEUED)
            forget_on(pipe, queue.name, [job.id])
            pipe.delete(keys.cancel_key(job.id))
            pipe.execute()
        durability.confirm(connection, f"the cancel of job {job.id}", replica_wait,
                           present=lambda: not connection.exists(keys.cancel_key(job.id))
                           and job.get_status(refresh=True) in TERMINAL_STATUSES)
        return True
    try:
        status = job.get_status(refresh=True)
    except InvalidJobOperation:  # the job expired meanwhile: nothing will run it
        return True
    if status == JobStatus.STARTED:
        stop_job(connection, job.id)  # the fast path; the recorded cancel is the sure one
    elif status in (JobStatus.DEFERRED, JobStatus.SCHEDULED):  # not in a queue list: RQ cancels it
        job.cancel()
    return True


def cancel_held(connection: Redis, job_ids: set[str], running: set[str]) -> None:
    """Cancel jobs that workers hold (taken from their queue, or `running`): the cancel is recorded first, so
    it wins where no worker hears RQ's stop-job command (one that just took the job, or died meanwhile); the
    command stops a running one within a step."""
    _record_cancels(connection, job_ids)
    for job_id in running:
        stop_job(connection, job_id)


def _record_cancels(connection: Redis, job_ids) -> None:
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.set(keys.cancel_key(job_id), 1, ex=keys.CANCEL_TTL_S)
        pipe.execute()
