"""The job contract: an RQ job names `batcher.jobs.generate` and carries one GenerationRequest as JSON.

A producer enqueues `generate` with `GenerationRequest.model_dump(mode="json")` as its only
argument and RQ's JSONSerializer. Only `batcher worker` runs these jobs, many at once on one model;
this module decodes and validates a job's argument for it, and says why when a job cannot run.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from batcher.openai_batch import readable
from batcher.schema import GenerationRequest

JOB_FUNCTION = "batcher.jobs.generate"
# A worker holds each job it runs on a lease this long, renewed by heartbeats; when a worker dies, its
# jobs are retried (RQ's Retry) about this long later.
DEFAULT_LEASE_S = 10
MAX_REASON_CHARS = 2000  # a failure reason is stored in Redis and printed by `batcher status`: keep it readable
PLAIN_WORKER_MESSAGE = (
    "batcher jobs run only on a batcher worker, which batches many of them on one model: "
    "start one with `batcher worker --queue <queue> --model <model>` (a plain `rq worker` cannot run them)"
)


class InvalidJob(ValueError):
    """A job that can never run, with the reason why (it fails without retries)."""


class NeedsBatchWorker(RuntimeError):
    """Raised when something other than BatchWorker tries to run a generate job."""


def generate(request: dict) -> dict:
    """The function a job names. BatchWorker never calls it; a plain `rq worker` does, and fails the job."""
    raise NeedsBatchWorker(PLAIN_WORKER_MESSAGE)


def bounded_reason(reason: str) -> str:
    """`reason`, cut to MAX_REASON_CHARS with a note of how much was left out."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    note = f" ... ({len(reason) - MAX_REASON_CHARS} more characters)"
    return reason[: MAX_REASON_CHARS - len(note)] + note


def job_argument(request: GenerationRequest) -> dict[str, Any]:
    return request.model_dump(mode="json")


def request_from_job(func_name: str | None, args: Any, kwargs: Any) -> GenerationRequest:
    """The request a job carries; raise InvalidJob with a readable reason if it carries none."""
    if func_name != JOB_FUNCTION:
        raise InvalidJob(f"a batcher worker runs only {JOB_FUNCTION} jobs, not {func_name!r}")
    if kwargs or not isinstance(args, (list, tuple)) or len(args) != 1 or not isinstance(args[0], dict):
        raise InvalidJob(f"{JOB_FUNCTION} takes one positional argument, a GenerationRequest as a JSON object")
    try:
        return GenerationRequest.model_validate(args[0])
    except ValidationError as exc:
        raise InvalidJob(f"invalid request: {readable(exc)}") from None


def request_of(job) -> GenerationRequest | None:
    """The request an RQ job carries, or None when it carries no readable one (pickled, or invalid)."""
    try:
        return request_from_job(job.func_name, job.args, job.kwargs)
    except Exception:  # noqa: BLE001  (RQ raises its own DeserializationError for pickled data)
        return None
