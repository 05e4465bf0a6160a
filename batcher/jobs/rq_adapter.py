"""Every use of RQ's internals and registries, in one place (pinned rq>=2.12,<3).

RQ's worker runs one job at a time; a batcher worker runs many at once, as RQ Executions of their own.
That needs RQ's private members and its one-job assumptions, and RQ 3 changes exactly these (executions
become a dict, the handlers take `execution=`): moving to it should be a change to this file alone.
The core reads and writes RQ's registries too (queue counts, requeueing failed jobs, cancelling a batch's
jobs, stopping running ones); those calls are here as well, so this module lives in the core, where both
the core and the worker import it (it needs rq and redis only). The facts it relies on are in
docs/rq-internals.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import redis
from redis import Redis
from rq import worker_registration
from rq.command import handle_command, parse_payload, send_shutdown_command, send_stop_job_command
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.exceptions import DeserializationError, InvalidJobOperation, NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry, clean_registries
from rq.serializers import JSONSerializer
from rq.suspension import WORKERS_SUSPENDED
from rq.utils import get_version, now
from rq.worker import BaseWorker, Worker, WorkerStatus

from rqbatcher.jobs.queues import backlog_add_on, backlog_remove_on
from rqbatcher.jobs.redis_text import as_text

# The worker's modules take RQ's public names from here too, so that they never import rq themselves.
__all__ = ["BaseJobWorker", "CommandThreadExit", "PromptExitWorker", "DeserializationError", "Execution",
           "InvalidJobOperation", "Job", "JobStatus", "NoSuchJobError", "Queue", "WORKERS_SUSPENDED", "WorkerStatus",
           "get_version", "pin_server_version", "failure_ttl", "taken_list_key", "rq_queue", "registry_counts",
           "requeue_failed_jobs", "cancel_taken_on", "held_job_ids", "stop_job", "shut_down_worker"]

SERVER_VERSION_ATTR = "__rq_redis_server_version"  # where RQ caches the server version it read with INFO
# How long RQ's started registry believes a batcher execution lasts without a renewal. Batcher's own lease
# (workers.job_worker.leases) is seconds long and its recovery acts on that; RQ's cleanup (`rq info`, another RQ
# worker's maintenance) only sees executions whose every batcher worker has been gone this long.
RQ_REGISTRY_HORIZON_S = 3600
PUBSUB_RETRY_S = 2.0  # RQ's own pause before its command thread reconnects
COMMAND_WAIT_S = 1.0  # the longest RQ's command thread waits at a time: what a worker's exit can wait on it
# KEYS: an intermediate list, its queue. ARGV: a job id. Moves the job back to the front, if it is still taken.
REQUEUE_TAKEN_LUA = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


def pin_server_version(connection: Redis, version: tuple[int, int, int]) -> None:
    """Tell RQ the server version of a Redis that answers no INFO (fakeredis)."""
    setattr(connection, SERVER_VERSION_ATTR, version)


class CommandThreadExit:
    """RQ's command thread waits 60 s at a time, and redis-py 8's `stop()` joins it with no timeout. A worker that
    unsubscribes while the thread starts another wait (the thread then waits for a subscription that never comes)
    took a minute to exit: about one burst in eight. Waits of COMMAND_WAIT_S bound that; a command still arrives
    at once, as the thread reads its channel whenever it is subscribed."""

    def subscribe(self) -> None:
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=COMMAND_WAIT_S, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)


class PromptExitWorker(CommandThreadExit, Worker):
    """RQ's stock worker (a forked process per job), whose exit never waits a minute on its command thread."""


class BaseJobWorker(CommandThreadExit, BaseWorker):
    """The RQ side of a worker with many jobs in flight: reliable dequeue, one Execution per job, result
    recording through RQ's handlers one job at a time, leases in the started registries, maintenance under
    a short lock, and RQ's commands. `rqbatcher.workers.job_worker.worker.JobWorker` builds its loop on these."""

    def __init__(self, queues: list[str], *, connection: Redis, name: str | None, lease_s: int,
                 maintenance_interval: int) -> None:
        super().__init__(list(queues), name=name, connection=connection, serializer=JSONSerializer,
                         maintenance_interval=maintenance_interval)
        self.lease_s = lease_s  # also how long a maintenance lock outlives a holder that died

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

    def _pubsub_exception_handler(self, exc: Exception, pubsub, pubsub_thread) -> None:
        """Keep RQ's command thread alive through any Redis fault: RQ's own handler retries a connection
        error but lets a timeout (a Redis that stopped answering) end the thread, and drains with it."""
        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            self.log.warning("worker %s: command channel lost (%s); reconnecting in %.0f s", self.name, exc,
                             PUBSUB_RETRY_S)
            time.sleep(PUBSUB_RETRY_S)
        else:
            raise exc

    # ----- taking and starting jobs -----
    def wait_for_work(self, queues: list[Queue], timeout: float, poll_s: float,
                      registries: dict[str, int] | None = None) -> bool:
        """Wait until any of `queues` holds a job, or a registry of queues (a set: its key -> its size as last read)
        changed, at most `timeout` s, without taking anything: the fair pick then chooses which job to take.

        Redis blocks without popping on one list only (a BLMOVE of its head onto itself), a multi-list pop can lose
        a job when its worker dies, and a blocking command's timeout is only as fine as the server's `hz` (100 ms by
        default): so every `poll_s` one EXISTS asks after every queue at once (an empty list does not exist), and a
        job on any of them, a plain RQ producer's too, is seen within `poll_s`."""
        registries = registries or {}
        deadline = time.monotonic() + timeout
        every = [queue.key for queue in queues]
        while True:
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.exists(*every)
                for key in registries:
                    pipe.scard(key)
                waiting, *sizes = pipe.execute()
            if waiting or sizes != list(registries.values()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))

    def stranded(self, queues: list[Queue]) -> dict[Queue, list[str]]:
        """The job ids waiting in each queue's intermediate list: taken, not started (yet)."""
        with self.connection.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.lrange(queue.intermediate_queue_key, 0, -1)
            lists = pipe.execute()
        return {queue: [as_text(i) for i in ids] for queue, ids in zip(queues, lists)
                if ids}

    def requeue_stranded(self, queue: Queue, job_ids: list[str], grace_s: float) -> int:
        """Put back at the front of `queue` the taken jobs seen in its intermediate list for `grace_s` or more: their
        worker died between taking and starting them. RQ's first-seen markers time them; the move is one script,
        so a job is requeued once. Returns how many."""
        intermediate, moved = queue.intermediate_queue, 0
        for job_id in job_ids:
            if intermediate.set_first_seen(job_id):
                continue
            first_seen = intermediate.get_first_seen(job_id)
            if first_seen is None or (now() - first_seen).total_seconds() < grace_s:
                continue
            moved += self.connection.eval(REQUEUE_TAKEN_LUA, 2, queue.intermediate_queue_key, queue.key, job_id)
            self.connection.delete(intermediate.get_first_seen_key(job_id))
        return moved

    def drop_taken(self, queue: Queue, job_id: str, pipe=None) -> None:
        """Forget a taken job that nothing can run (deleted meanwhile, unreadable, or a duplicate), now or on `pipe`."""
        if pipe is None:
            with self.connection.pipeline() as own:
                self.drop_taken(queue, job_id, own)
                own.execute()
            return
        pipe.lrem(queue.intermediate_queue_key, 1, job_id)
        backlog_remove_on(pipe, queue.name, [job_id])

    def start_on(self, pipe, job: Job, queue: Queue) -> Execution:
        """Queue, on a MULTI pipeline, what starts `job` as an Execution of this worker.

        RQ's started registry gets a long lease (RQ_REGISTRY_HORIZON_S): the real lease is batcher's own
        (`workers.job_worker.leases`), and RQ's cleanup must never race batcher's recovery for the same job."""
        execution = Execution.create(job, RQ_REGISTRY_HORIZON_S, pipeline=pipe, worker_name=self.name)
        job.prepare_for_execution(self.name, pipeline=pipe)
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        backlog_remove_on(pipe, queue.name, [job.id])
        pipe.persist(job.key)  # the queue TTL no longer applies
        return execution

    @staticmethod
    def keep_started_on(pipe, queue: Queue, execution: Execution) -> None:
        """Queue a renewal of the execution's entry in RQ's started registry (ZADD XX: never revived)."""
        execution.heartbeat(queue.started_job_registry, RQ_REGISTRY_HORIZON_S, pipeline=pipe)

    def execution_of(self, job: Job, execution_id: str) -> Execution:
        return Execution(id=execution_id, job_id=job.id, connection=self.connection)

    def result_ttl(self, job: Job) -> int:
        return job.get_result_ttl(self.default_result_ttl)


    # ----- ending a job: what RQ's handlers write, queued on the caller's transaction -----
    def success_on(self, pipe, job: Job, queue: Queue, execution: Execution, return_value: dict) -> None:
        """Queue what RQ's success handler writes: the Result, the finished registry, the job's status and TTL."""
        job.ended_at = now()
        job._result = return_value
        result_ttl = self.result_ttl(job)
        job.set_status(JobStatus.FINISHED, pipeline=pipe)
        if result_ttl != 0:
            job._handle_success(result_ttl, pipeline=pipe, worker_name=self.name, execution_id=execution.id,
                                execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        execution.delete(job=job, pipeline=pipe)
        self.increment_successful_job_count(pipeline=pipe)
        if job.started_at:
            self.increment_total_working_time(job.ended_at - job.started_at, pipe)

    def failure_on(self, pipe, job: Job, queue: Queue, execution: Execution, reason: str, stopped: bool) -> None:
        """Queue what RQ's failure handler writes, without a retry: the failed registry, a failed Result and the
        job's status, STOPPED for a job cancelled by a stop-job command. A failure is the request's own and would
        happen again (a lost worker is not a failure: its job is requeued by `requeue_on`)."""
        job.ended_at = now()
        if not stopped:
            job.retries_left = 0
        job.set_status(JobStatus.STOPPED if stopped else JobStatus.FAILED, pipeline=pipe)
        execution.delete(job=job, pipeline=pipe)
        job._handle_failure(reason, pipeline=pipe, worker_name=self.name, execution_id=execution.id,
                            execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
        self.increment_failed_job_count(pipe)
        if job.started_at:
            self.increment_total_working_time(job.ended_at - job.started_at, pipe)

    @staticmethod
    def requeue_on(pipe, job: Job, queue: Queue, execution: Execution) -> None:
        """Queue the end of an execution and the job's return to the front of its queue, without using a retry."""
        execution.delete(job=job, pipeline=pipe)
        queue.enqueue_job(job, pipeline=pipe, at_front=True)
        backlog_add_on(pipe, queue.name, {job.id: job.ttl})

    # ----- maintenance -----
    def clean_registries(self) -> None:
        """RQ's periodic maintenance (run_maintenance_tasks calls it), under a lock that expires in one lease.

        RQ's own lock lasts 15 minutes if its holder dies, and would stall every worker's recovery."""
        for queue in self.queues:
            with self.maintenance_lock(queue) as held:
                if held:
                    clean_registries(queue, self._exc_handlers)
                    worker_registration.clean_worker_registry(queue)
                    # Not RQ's intermediate-queue cleanup: it fails a stranded job (`requeue_stranded` requeues it).
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


# ----- what the core does with RQ's registries and commands (admin, batches, cancel) -----
def failure_ttl(job: Job) -> int:
    """How long a job's failure (and its stream) stays readable: its own setting, else RQ's default."""
    return job.failure_ttl if job.failure_ttl is not None else DEFAULT_FAILURE_TTL


def taken_list_key(queue: Queue) -> str:
    """Where a job taken from `queue` waits until it is started: RQ's intermediate list, which its reliable dequeue
    moves jobs into (LMOVE), so that a worker's crash loses none. A fair pick that takes jobs itself moves them
    there."""
    return queue.intermediate_queue_key


def rq_queue(name: str, connection: Redis) -> Queue:
    """An RQ queue of batcher jobs (JSON serializer)."""
    return Queue(name, connection=connection, serializer=JSONSerializer)


def registry_counts(queue: Queue) -> tuple[int, int, int]:
    """(started, failed, finished) jobs of a queue, as RQ's registries count them."""
    return queue.started_job_registry.count, queue.failed_job_registry.count, queue.finished_job_registry.count


def requeue_failed_jobs(queue: Queue) -> list[str]:
    """Put every job of the queue's failed registry back on the queue; return their ids."""
    registry = FailedJobRegistry(queue=queue, serializer=JSONSerializer)
    job_ids = registry.get_job_ids()
    for job_id in job_ids:
        registry.requeue(job_id)
        # RQ's requeue takes no pipeline: counted after it, so a crash between undercounts, never counts a ghost
        with queue.connection.pipeline() as pipe:
            backlog_add_on(pipe, queue.name, {job_id: None})
            pipe.execute()
    return job_ids


def cancel_taken_on(pipe, queue: Queue, job_ids: Iterable[str]) -> None:
    """Queue, for jobs just taken out of `queue`'s list, what RQ's cancel records: the status and the
    canceled registry."""
    job_ids = list(job_ids)
    for job_id in job_ids:
        job = Job(job_id, connection=queue.connection, serializer=JSONSerializer)
        job.set_status(JobStatus.CANCELED, pipeline=pipe)
        queue.canceled_job_registry.add(job, pipeline=pipe)
    backlog_remove_on(pipe, queue.name, job_ids)


def held_job_ids(connection: Redis, queues: list[Queue], prefix: str) -> tuple[set[str], set[str]]:
    """The ids starting with `prefix` of the jobs a worker holds on these queues: (taken from the queue but not
    started yet, started)."""
    with connection.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.lrange(queue.intermediate_queue_key, 0, -1)
        taken = {as_text(j) for ids in pipe.execute() for j in ids if as_text(j).startswith(prefix)}
    started = {job_id for queue in queues for job_id in queue.started_job_registry.get_job_ids(cleanup=False)
               if job_id.startswith(prefix)}
    return taken, started


def stop_job(connection: Redis, job_id: str) -> None:
    """RQ's stop-job command to whichever worker runs the job; nothing if it is not running (any more)."""
    with contextlib.suppress(InvalidJobOperation, NoSuchJobError):
        send_stop_job_command(connection, job_id, serializer=JSONSerializer)


def shut_down_worker(connection: Redis, name: str) -> None:
    """RQ's shutdown command: the worker drains (stops admitting, finishes its jobs) and exits."""
    send_shutdown_command(connection, name)
