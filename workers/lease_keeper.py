"""The lease keeper: a thread that keeps a worker's jobs leased, whatever the engine is doing.

A job's lease is its score in RQ's started registry. Every lease/HEARTBEATS_PER_LEASE seconds the keeper
takes a snapshot of the jobs in flight, extends their leases in one pipeline (with the worker's own
heartbeat and stats), and reports the jobs whose lease was lost: gone from the registry, or expired
before this heartbeat, so another worker may already be running them. It also recovers the jobs of dead
workers (expired leases) within seconds, where RQ's own maintenance would take ten minutes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from batcher.redis_retry import REDIS_ERRORS
from workers.rq_adapter import BaseBatchWorker, Execution, Queue, current_timestamp

log = logging.getLogger(__name__)

HEARTBEATS_PER_LEASE = 3  # keeper ticks per lease: two may be late before a lease runs out


class Leased(Protocol):
    """A job in flight as the keeper sees it."""

    queue: Queue
    execution: Execution


class LeaseKeeper:
    """Runs `tick()` every lease/HEARTBEATS_PER_LEASE seconds on its own thread, from `start()` to `stop()`.

    `in_flight()` gives the snapshot; `on_beat(pipe)` adds the worker's own heartbeat to the pipeline;
    `on_lost(jobs)` hears of jobs whose lease is gone (called on the keeper's thread)."""

    def __init__(self, worker: BaseBatchWorker, in_flight: Callable[[], Sequence[Leased]],
                 on_beat: Callable[[object], None], on_lost: Callable[[list[Leased]], None]) -> None:
        self.worker = worker
        self.in_flight, self.on_beat, self.on_lost = in_flight, on_beat, on_lost
        self.interval_s = worker.lease_s / HEARTBEATS_PER_LEASE
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-keeper-{worker.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except REDIS_ERRORS as exc:  # unreachable for a moment: the next tick tries again
                log.warning("worker %s: could not keep leases (%s); retrying in %.1f s", self.worker.name, exc,
                            self.interval_s)
            except Exception:
                log.exception("worker %s: lease keeping failed", self.worker.name)

    def tick(self) -> None:
        """One round: extend every lease of a snapshot, report the lost ones, recover expired ones."""
        lost = self.extend(list(self.in_flight()))
        if lost:
            self.on_lost(lost)
        self.recover_expired()

    def extend(self, jobs: list[Leased]) -> list[Leased]:
        """Extend the leases of `jobs` (and beat); return those whose lease was gone or had expired.

        An expired lease is not revived, even if its entry is still there: another worker's cleanup may be
        retrying that job already."""
        worker = self.worker
        with worker.connection.pipeline(transaction=False) as pipe:
            self.on_beat(pipe)
            before_at, after_at = [], []
            for job in jobs:
                before_at.append(len(pipe))
                worker.read_lease(pipe, job.queue, job.execution)
                worker.extend_lease(pipe, job.queue, job.execution, worker.lease_s)
                after_at.append(len(pipe))
                worker.read_lease(pipe, job.queue, job.execution)
            checked_at = current_timestamp()
            replies = pipe.execute()
        return [job for job, before, after in zip(jobs, before_at, after_at)
                if replies[after] is None or (replies[before] or 0) < checked_at]

    def recover_expired(self) -> None:
        """Run RQ's started-registry cleanup on each queue that has an expired lease: it retries those jobs."""
        worker = self.worker
        with worker.connection.pipeline(transaction=False) as pipe:
            for queue in worker.queues:
                worker.read_first_expired(pipe, queue)
            expired = pipe.execute()
        for queue, hit in zip(worker.queues, expired):
            if hit and worker.recover_expired(queue):
                log.info("worker %s: recovered jobs with expired leases on %s", worker.name, queue.name)
