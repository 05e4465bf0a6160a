"""Every use of RQ's internals, in one place (pinned rq>=2.12,<3).

RQ's worker runs one job at a time; a batcher worker runs many at once, as RQ Executions of their own.
That needs RQ's private members and its one-job assumptions, and RQ 3 changes exactly these (executions
become a dict, the handlers take `execution=`): moving to it should be a change to this file alone.
The facts this module relies on are in docs/rq-internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from redis import Redis
from rq import worker_registration
from rq.command import handle_command, parse_payload
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.exceptions import DequeueTimeout, DeserializationError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import clean_registries
from rq.serializers import JSONSerializer
from rq.suspension import WORKERS_SUSPENDED
from rq.utils import current_timestamp, get_version, now
from rq.worker import BaseWorker, WorkerStatus

# The worker module takes RQ's public names from here too, so that it never imports rq itself.
__all__ = ["BaseBatchWorker", "DeserializationError", "Execution", "Job", "Queue", "WORKERS_SUSPENDED",
           "WorkerStatus", "current_timestamp", "get_version", "now", "pin_server_version"]

AlsoRecord = Callable[[object], None]  # queues commands on the MULTI pipeline that records a job's end
SERVER_VERSION_ATTR = "__rq_redis_server_version"  # where RQ caches the server version it read with INFO


def pin_server_version(connection: Redis, version: tuple[int, int, int]) -> None:
    """Tell RQ the server version of a Redis that answers no INFO (fakeredis)."""
    setattr(connection, SERVER_VERSION_ATTR, version)


class BaseBatchWorker(BaseWorker):
    """The RQ side of a worker with many jobs in flight: reliable dequeue, one Execution per job, result
    recording through RQ's handlers one job at a time, leases in the started registries, maintenance under
    a short lock, and RQ's commands. `workers.rq_worker.BatchWorker` builds its loop on these."""

    def __init__(self, queues: list[str], *, connection: Redis, name: str | None, lease_s: int,
                 maintenance_interval: int) -> None:
        super().__init__(list(queues), name=name, connection=connection, serializer=JSONSerializer,
                         maintenance_interval=maintenance_interval)
        self.lease_s = lease_s  # also how long a maintenance lock outlives a holder that died
        self._also: tuple[Job, AlsoRecord] | None = None  # what joins the result transaction being written

    # ----- draining and commands -----
    @property
    def drain_requested(self) -> bool:
        return self._stop_requested

    def mark_draining(self) -> None:
        """What RQ's own stop handler records: no new jobs from now on."""
        self._stop_requested = True
        self._shutdown_requested_date = now()

    def install_signal_handlers(self) -> None:
        self._install_signal_handlers()

    def handle_payload(self, message) -> None:
        """RQ commands (pubsub thread). stop-job is taken for any job in flight, not only a 'current' one."""
        try:
            payload = parse_payload(message)
        except (ValueError, KeyError, AttributeError):  # an exception here would end RQ's pubsub thread
            self.log.warning("worker %s: ignoring a malformed command %r", self.name, message)
            return
        if payload.get("command") == "stop-job":
            self.stop_job_requested(str(payload.get("job_id")))
        else:
            handle_command(self, payload)  # shutdown arrives as SIGINT, so it drains

    def stop_job_requested(self, job_id: str) -> None:
        """Called from the pubsub thread when RQ's stop-job command names `job_id`."""
        raise NotImplementedError

    # ----- taking and starting jobs -----
    def take(self, queue: Queue, n: int) -> list[str]:
        """Up to `n` job ids from one queue, each moved (LMOVE) into the queue's intermediate list: a job
        taken there survives this worker's crash (RQ's maintenance requeues it)."""
        with self.connection.pipeline(transaction=False) as pipe:
            for _ in range(n):
                pipe.lmove(queue.key, queue.intermediate_queue_key)
            return [job_id.decode() if isinstance(job_id, bytes) else job_id
                    for job_id in pipe.execute() if job_id is not None]

    def wait_for_job(self, queue: Queue, timeout: int) -> Job | None:
        """Block (BLMOVE) on one queue for a job: only one queue can be watched reliably."""
        try:
            got = self.queue_class.dequeue_any([queue], timeout, connection=self.connection,
                                               job_class=self.job_class, serializer=self.serializer)
        except DequeueTimeout:
            return None
        return got[0] if got else None

    def drop_taken(self, queue: Queue, job_id: str) -> None:
        """Forget a taken job that nothing can run (deleted meanwhile, or unreadable)."""
        self.connection.lrem(queue.intermediate_queue_key, 1, job_id)

    def start_execution(self, pipe, job: Job, queue: Queue, lease_s: int) -> Execution:
        """Queue, on a MULTI pipeline, what starts `job` as an Execution of this worker under a lease."""
        execution = Execution.create(job, lease_s, pipeline=pipe, worker_name=self.name)
        job.prepare_for_execution(self.name, pipeline=pipe)
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        pipe.persist(job.key)  # the queue TTL no longer applies
        return execution

    def result_ttl(self, job: Job) -> int:
        return job.get_result_ttl(self.default_result_ttl)

    @staticmethod
    def failure_ttl(job: Job) -> int:
        return job.failure_ttl if job.failure_ttl is not None else DEFAULT_FAILURE_TTL

    # ----- leases -----
    @staticmethod
    def read_lease(pipe, queue: Queue, execution: Execution) -> None:
        """Queue a read of an execution's lease: its score (expiry timestamp) in the started registry, or None."""
        pipe.zscore(queue.started_job_registry.key, execution.composite_key)

    @staticmethod
    def extend_lease(pipe, queue: Queue, execution: Execution, lease_s: int) -> None:
        """Queue a lease extension (ZADD XX: a lease already gone is never revived)."""
        execution.heartbeat(queue.started_job_registry, lease_s, pipeline=pipe)

    @staticmethod
    def read_first_expired(pipe, queue: Queue) -> None:
        """Queue a read of one expired lease of `queue`, if any."""
        pipe.zrangebyscore(queue.started_job_registry.key, 0, current_timestamp(), start=0, num=1)

    def recover_expired(self, queue: Queue) -> bool:
        """Retry (or fail, once out of retries) the jobs of `queue` whose lease expired; False if another
        worker holds the cleaning lock right now."""
        with self.maintenance_lock(queue) as held:
            if held:
                queue.started_job_registry.cleanup()
            return held

    # ----- recording a job's end -----
    def record_success(self, job: Job, queue: Queue, execution: Execution, return_value: dict,
                       also: AlsoRecord | None = None) -> None:
        """Write the job's Result and registries through RQ's success handler; `also(pipe)` queues more
        commands in the handler's transaction (a batch line, counts, feed entries)."""
        job.ended_at = now()
        job._result = return_value
        job._status = JobStatus.FINISHED
        with self._as_current(execution, job, also):
            self.handle_job_success(job, queue, queue.started_job_registry)

    def record_failure(self, job: Job, queue: Queue, execution: Execution, reason: str, stopped: bool,
                       also: AlsoRecord | None = None) -> None:
        """Write the job's failure through RQ's failure handler, without a retry: `stopped` marks a job
        cancelled by a stop-job command; any other failure is the request's own and would fail again
        (retries are for lost workers). `also(pipe)` joins the transaction that writes the failed Result."""
        job.ended_at = now()
        if not stopped:
            job.retries_left = 0
        job._status = JobStatus.FAILED
        with self._as_current(execution, job, also):
            if stopped:
                self._stopped_job_id = job.id  # the handler then marks it stopped
            try:
                self.handle_job_failure(job, queue, queue.started_job_registry, exc_string=reason)
            finally:
                self._stopped_job_id = None

    @contextmanager
    def _as_current(self, execution: Execution, job: Job, also: AlsoRecord | None) -> Iterator[None]:
        """RQ's handlers read the worker's single current execution: lend them this job's, one at a time."""
        self.execution = execution
        self._also = (job, also) if also is not None else None
        try:
            yield
        finally:
            self.execution = None
            self._also = None

    def cleanup_execution(self, job: Job, pipeline) -> None:
        """Both of RQ's handlers call this inside the transaction that writes the job's Result (without a
        retry, which our recording never asks for): the place where `also` joins that transaction."""
        super().cleanup_execution(job, pipeline)
        joining, self._also = self._also, None  # once, even if a handler called this twice
        if joining is not None and joining[0] is job:
            joining[1](pipeline)

    def requeue_at_front(self, in_flight: list[tuple[Job, Queue, Execution]]) -> None:
        """Put jobs in flight back at the front of their queues, in their order, without using a retry."""
        with self.connection.pipeline() as pipe:
            pipe.multi()  # enqueue_job wants the pipeline in MULTI before it is given commands
            for job, queue, execution in reversed(in_flight):
                execution.delete(job=job, pipeline=pipe)
                queue.enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()

    # ----- maintenance -----
    def clean_registries(self) -> None:
        """RQ's periodic maintenance (run_maintenance_tasks calls it), under a lock that expires in one lease.

        RQ's own lock lasts 15 minutes if its holder dies, and would stall every worker's recovery."""
        for queue in self.queues:
            with self.maintenance_lock(queue) as held:
                if held:
                    clean_registries(queue, self._exc_handlers)
                    worker_registration.clean_worker_registry(queue)
                    queue.intermediate_queue.cleanup(self, queue)
        self.last_cleaned_at = now()

    @contextmanager
    def maintenance_lock(self, queue: Queue) -> Iterator[bool]:
        """RQ's per-queue cleaning lock: one cleaner at a time across workers and threads, so no expired
        job is retried twice. It expires one lease after a holder that died."""
        held = bool(self.connection.set(queue.registry_cleaning_key, self.name, nx=True, ex=self.lease_s))
        try:
            yield held
        finally:
            if held:
                queue.release_maintenance_lock()
