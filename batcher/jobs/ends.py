"""A job's end, written in one place: everything that records it, queued on the transaction its caller runs.

A job ends in one of three hands, and each records the end with `record_end`:
- the worker that ran it (finished, failed, or stopped by a cancel), in the transaction fenced by its lease;
  its own fenced stream writer has buffered the terminal stream event;
- the worker that recovered it after its worker was lost (cancelled meanwhile, or started too often);
- the client that cancelled it while it was still queued (`rqbatcher.jobs.life.cancel`).
`record_end` queues RQ's side of the end (the Result and registries, or RQ's cancel for a job that never
started), the terminal stream event where the caller has no fenced writer, the job's outcome (its batch line,
counts and completion-feed entries), the fairness charge of the tenant the pick charged, and a background
response's webhook event (on the outbox).

The outcome is recorded by the function the caller passes (`rqbatcher.batches.lines.record_outcome_on`): a batch
line is OpenAI's format, which the job system does not know, and a required argument cannot be forgotten.
"""

from __future__ import annotations

import json
import time
from typing import Literal, Protocol

from rqbatcher.jobs import keys
from rqbatcher.jobs.fairness import charge_on
from rqbatcher.jobs.rq_adapter import BaseJobWorker, Execution, Job, JobStatus, Queue, cancel_taken_on, failure_ttl
from rqbatcher.jobs.stream import append_event
from rqbatcher.schema import GenerationRequest, GenerationResult, StreamEvent

# RQ's statuses of a job that has ended: nothing will run it again, and its end is recorded.
TERMINAL_STATUSES = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED)

EndStatus = Literal["finished", "failed", "stopped"]
# How a background response's end is announced (its webhook event `response.<ending>`): a finished job that ran out
# of tokens or time is an incomplete response
INCOMPLETE_FINISH_REASONS = ("length", "timeout")
RESPONSE_ENDINGS = {"finished": "completed", "failed": "failed", "stopped": "cancelled"}


class OutcomeRecorder(Protocol):
    """Queues on `pipe` a job's outcome where its readers look for it (`rqbatcher.batches.lines.record_outcome_on`)."""

    def __call__(self, pipe, *, job_id: str, queue: str, status: str, request: GenerationRequest | None,
                 result: GenerationResult | None = None, reason: str | None = None) -> None: ...


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
               record_outcome: OutcomeRecorder, result: GenerationResult | None = None, reason: str | None = None,
               worker: BaseJobWorker | None = None, execution: Execution | None = None,
               charged_tenant: str | None = None, stream_event: bool = True) -> None:
    """Queue on `pipe` (a transaction in MULTI) everything that records the end of `job`.

    `status`: finished (with `result`), failed (with `reason`) or stopped (cancelled; with the partial `result`
    where it ran). With `worker` and `execution`, RQ records it as that execution's end (Result, registries,
    worker counters); without, the job never started and RQ records a cancel. `charged_tenant`: the tenant the
    worker's pick charged for the job, charged now what it really cost. `stream_event=False` where the caller's
    fenced stream writer has the terminal event."""
    if worker is None:
        cancel_taken_on(pipe, queue, [job.id])
    elif status == "finished":
        worker.success_on(pipe, job, queue, execution, result.model_dump(mode="json"))
    else:
        worker.failure_on(pipe, job, queue, execution, reason, stopped=status == "stopped")
    if stream_event:
        ttl = worker.result_ttl(job) if status == "finished" else failure_ttl(job)
        append_event(pipe, job.id, terminal_event(status, result, reason), ttl)
    record_outcome(pipe, job_id=job.id, queue=queue.name, status=status, request=request, result=result,
                   reason=reason)
    if charged_tenant is not None:
        charge_end_on(pipe, queue.name, charged_tenant, result)
    if request is not None and request.background_response:
        announce_response_end_on(pipe, request, status, result)


def charge_end_on(pipe, queue_name: str, tenant: str, result: GenerationResult | None) -> None:
    """Queue the charge of the tenant the pick charged, for a job that ended (nothing generated when it carries no
    result): its fair-share counter (`rqbatcher.jobs.fairness`)."""
    usage = result.usage if result is not None else None
    charge_on(pipe, queue_name, tenant, usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0)


def announce_response_end_on(pipe, request: GenerationRequest, status: EndStatus,
                             result: GenerationResult | None) -> None:
    """Push a background response's end onto the webhook outbox (batcher/webhooks), in the transaction that records
    it: announced once it happened, never lost."""
    ending = RESPONSE_ENDINGS[status]
    if status == "finished" and result is not None and result.finish_reason in INCOMPLETE_FINISH_REASONS:
        ending = "incomplete"
    pipe.rpush(keys.WEBHOOK_OUTBOX, json.dumps({"type": f"response.{ending}", "id": request.background_response,
                                                "tenant": request.tenant, "created_at": int(time.time())}))
