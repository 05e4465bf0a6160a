"""The job contract: an RQ job names `rqbatcher.jobs.generate` and carries one GenerationRequest as JSON.

A producer enqueues `generate` with `GenerationRequest.model_dump(mode="json")` as its only
argument and RQ's JSONSerializer. Only `batcher worker` runs these jobs, many at once on one model
(`rqbatcher.jobs.life` decodes a job, `rqbatcher.jobs.ends` records its end).
"""

from __future__ import annotations

from typing import Any

from rqbatcher.schema import GenerationRequest

JOB_FUNCTION = "rqbatcher.jobs.generate"
# A worker holds each job it runs on a lease this long, renewed by heartbeats; when a worker dies, its
# jobs are run again by the survivors about this long later (workers/job_worker/leases.py).
DEFAULT_LEASE_S = 10
MAX_REASON_CHARS = 2000  # a failure reason is stored in Redis and printed by `batcher status`: keep it readable
PLAIN_WORKER_MESSAGE = (
    "batcher jobs run only on a batcher worker, which batches many of them on one model: "
    "start one with `batcher worker --queue <queue> --model <model>` (a plain `rq worker` cannot run them)"
)


class NeedsBatcherWorker(RuntimeError):
    """Raised when something other than a batcher worker tries to run a generate job."""


def generate(request: dict) -> dict:
    """The function a job names. A batcher worker never calls it; a plain `rq worker` does, and fails the job."""
    raise NeedsBatcherWorker(PLAIN_WORKER_MESSAGE)


def bounded_reason(reason: str) -> str:
    """`reason`, cut to MAX_REASON_CHARS with a note of how much was left out."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    note = f" ... ({len(reason) - MAX_REASON_CHARS} more characters)"
    return reason[: MAX_REASON_CHARS - len(note)] + note


def job_argument(request: GenerationRequest) -> dict[str, Any]:
    return request.model_dump(mode="json")
