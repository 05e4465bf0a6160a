"""The jobs a worker has in flight, and every flag other threads raise about them, behind one owner.

The worker's loop owns the jobs: it adds, ends and forgets them. Two other threads only raise flags, under
one lock: RQ's command thread asks for a job to stop (stop-job), and the lease keeper reports leases lost and
reads a snapshot of the jobs to renew. The loop takes the flags before each step (`take_stop_requests`,
`lost`). `wait` lets an idle loop sleep until a flag is raised.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from rqbatcher.jobs import ends as job_ends
from rqbatcher.jobs.contract import bounded_reason
from rqbatcher.jobs.rq_adapter import Execution, Job, Queue
from rqbatcher.schema import ChatFormat, GenerationRequest, GenerationResult

EndStatus = job_ends.EndStatus | Literal["lost"]  # lost: another worker holds the job now


@dataclass(frozen=True)
class JobEnd:
    """How an in-flight job ended (what `on_job_end` receives).

    finished: `result` holds it (finish reason stop, length or timeout); failed: `reason` says why;
    stopped: cancelled by a stop-job command, `result` holds the partial text; lost: another worker
    holds the job's lease now, and this worker recorded nothing."""

    job_id: str
    execution_id: str  # also the engine's request id
    queue: str
    status: EndStatus
    result: GenerationResult | None = None
    reason: str | None = None
    request: GenerationRequest | None = None  # what the job carried (None: nothing readable)


_END_ORDER = itertools.count()


@dataclass(eq=False)
class InFlight:
    """A job this worker has started: its RQ objects, its lease's TTLs, and how it ended.

    A job that ended keeps its `end` until the end is recorded: if Redis is unreachable meanwhile, the
    keeper keeps its lease and the next iteration tries again; `end_event_buffered` says its last stream
    event already waits in the stream buffer (which outlives a failed flush), so it is written once."""

    job: Job
    queue: Queue
    execution: Execution
    admitted_at: float  # time.monotonic()
    result_ttl: int
    failure_ttl: int
    tenant: str  # whose fair-share counter the pick charged (`rqbatcher.jobs.fairness`); the end corrects it
    timeout_at: float | None = None
    request: GenerationRequest | None = None  # None until decoded, or if the job carries no valid request
    chat_format: ChatFormat | None = None  # a chat job's: how its answer is read (on its `start` and its result)
    end: JobEnd | None = None
    end_order: int = 0  # jobs that ended in the same iteration are recorded in the order they ended
    end_event_buffered: bool = False
    lease_lost: bool = False  # raised by the lease keeper's thread; acted on by the loop

    @property
    def id(self) -> str:
        """The execution's id, which is also the engine's request id."""
        return self.execution.id

    def ended(self, status: EndStatus, result: GenerationResult | None = None, reason: str | None = None) -> None:
        """Note how the job ended; the first end wins."""
        if self.end is None:
            reason = None if reason is None else bounded_reason(reason)
            self.end = JobEnd(self.job.id, self.execution.id, self.queue.name, status, result, reason, self.request)
            self.end_order = next(_END_ORDER)


class InFlightJobs:
    """The in-flight jobs, by execution id, and the cross-thread flags about them."""

    def __init__(self) -> None:
        self._jobs: dict[str, InFlight] = {}
        self._stop_requests: set[str] = set()  # job ids, from RQ's command thread
        self._lock = threading.Lock()
        self._wake = threading.Event()  # cuts an idle wait short (signal, stop-job, lost lease)

    # ----- the loop's own -----
    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(list(self._jobs.values()))

    def get(self, execution_id: str) -> InFlight | None:
        return self._jobs.get(execution_id)

    def add(self, f: InFlight) -> None:
        with self._lock:
            self._jobs[f.id] = f

    def remove(self, f: InFlight) -> None:
        with self._lock:
            self._jobs.pop(f.id, None)

    def clear(self) -> None:
        with self._lock:
            self._jobs.clear()

    def of_job(self, job_id: str) -> list[InFlight]:
        """The executions of one job here (two only when this worker runs it again after losing its lease)."""
        return [f for f in self._jobs.values() if f.job.id == job_id]

    def ended(self) -> list[InFlight]:
        """The jobs that ended and wait for their end to be recorded, in the order they ended."""
        return sorted((f for f in self._jobs.values() if f.end is not None), key=lambda f: f.end_order)

    def lost(self) -> list[InFlight]:
        return [f for f in self._jobs.values() if f.lease_lost]

    def take_stop_requests(self) -> set[str]:
        """The job ids that stop-job commands named since the last call."""
        with self._lock:
            stops, self._stop_requests = self._stop_requests, set()
            self._wake.clear()
        return stops

    def wait(self, timeout: float) -> None:
        """Sleep until another thread raises a flag, or `timeout` passes."""
        self._wake.wait(timeout)

    # ----- other threads' -----
    def snapshot(self) -> list[InFlight]:
        with self._lock:
            return list(self._jobs.values())

    def request_stop(self, job_id: str) -> None:
        with self._lock:
            self._stop_requests.add(job_id)
        self._wake.set()

    def mark_cancelled(self, jobs: list[InFlight]) -> None:
        """Jobs the keeper found cancelled: the durable path, where a stop-job command was missed."""
        for f in jobs:
            self.request_stop(f.job.id)

    def mark_lost(self, jobs: list[InFlight]) -> None:
        for f in jobs:
            f.lease_lost = True
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()
