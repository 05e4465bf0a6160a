"""A job's life on Redis: what it carries, and how it is cancelled (its end is recorded by `rqbatcher.jobs.ends`).

A cancel is recorded in Redis (`keys.cancel_key`) before RQ's stop-job command is sent, so it wins even where
no worker hears the command: a worker checks it when it starts the job, each time it renews the job's lease,
and when it recovers the job of a lost worker.
"""

from __future__ import annotations

from pydantic import ValidationError
from redis import Redis

from rqbatcher.errors import readable
from rqbatcher.jobs import durability, keys
from rqbatcher.jobs.contract import JOB_FUNCTION
from rqbatcher.jobs.ends import TERMINAL_STATUSES, OutcomeRecorder, record_end
from rqbatcher.jobs.fairness import forget_on
from rqbatcher.jobs.rq_adapter import DeserializationError, InvalidJobOperation, Job, JobStatus, rq_queue, stop_job
from rqbatcher.schema import GenerationRequest

CANCELLED_WHILE_QUEUED = "cancelled while queued"
PICKLED_JOB_REASON = (
    "the job data is not JSON; it was probably enqueued with RQ's default pickle serializer. Enqueue with "
    "serializer=rq.serializers.JSONSerializer (a batcher worker never unpickles job data)"
)


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


# ----- cancel -----
def cancel(connection: Redis, job: Job, status: JobStatus, record_outcome: OutcomeRecorder,
           replica_wait: durability.ReplicaWait | None = None) -> bool:
    """Cancel a job (its current `status` just read): a queued one never runs (its end recorded at once, its
    outcome by `record_outcome`), a running one stops within one step (its partial text stays in its stream), and
    one whose worker was lost is not started again. False if the job had already ended."""
    if status in TERMINAL_STATUSES:
        return False
    _record_cancels(connection, [job.id])  # first: from here on, no worker runs it, whatever happens next
    queue = rq_queue(job.origin, connection)
    if queue.remove(job.id):  # atomic: no worker can take it any more
        with connection.pipeline() as pipe:
            pipe.multi()
            record_end(pipe, job, queue, "stopped", request=readable_request(job), record_outcome=record_outcome,
                       reason=CANCELLED_WHILE_QUEUED)
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
