"""BatchWorker: an RQ worker that keeps many generation jobs in flight on one Engine.

This is the only module that touches rq internals (pinned rq>=2.12,<3; the facts it relies on are
in ../shared/notes/rq-batch-worker.md). Its own loop replaces RQ's one-job-at-a-time `work()`:

- admit: while the engine has free slots, take jobs from the queues in priority order through RQ's
  reliable single-queue dequeue (LMOVE into the queue's intermediate list, batched per queue), and
  start each as its own RQ Execution; block on Redis only when the engine is idle;
- step the engine once, and queue every sequence's stream events (workers/streams.py writes them
  in one pipeline);
- record each ended job through RQ's success and failure handlers, after checking that this worker
  still holds the job's lease, and after its last stream event is written.

Everything that changes a job happens on the loop's thread, so RQ's handlers, which assume a single
current job, run one at a time. A second thread (the lease keeper) extends every in-flight lease and
recovers the jobs of dead workers, whatever the engine is doing.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
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
from rq.utils import as_text, current_timestamp, get_version, now
from rq.worker import BaseWorker, WorkerStatus

from batcher import keys
from batcher.batches import record_job_end
from batcher.jobs import DEFAULT_LEASE_S, InvalidJob, request_from_job
from batcher.scheduler import Sequence
from batcher.schema import GenerationRequest, GenerationResult, Timings
from workers.engine import Engine, RequestError, RequestOutput
from workers.streams import StreamWriter

log = logging.getLogger(__name__)

STATS_TTL_LEASES = 2  # a worker's published stats outlive one missed heartbeat, not a dead worker
HEARTBEATS_PER_LEASE = 3  # keeper ticks per lease: two may be late before a lease runs out
DEFAULT_MAINTENANCE_INTERVAL_S = 60  # RQ's full registry maintenance (intermediate lists, dead workers)
IDLE_WAIT_S = 1  # the longest an idle worker blocks on Redis (or waits while suspended)
BUSY_RESCAN_S = 0.02  # a busy worker that found nothing to admit looks again after this long, not every step
MIN_REDIS_VERSION = (6, 2, 0)  # LMOVE, which RQ's reliable dequeue needs
# Redis unreachable (down, restarting, loading its AOF): redis-py retries each command for a few seconds
# by itself; past that the worker backs off, from the first delay doubling up to the last, and goes on.
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError)
REDIS_BACKOFF_S = (0.5, 5.0)
PICKLED_JOB_REASON = (
    "the job data is not JSON; it was probably enqueued with RQ's default pickle serializer. Enqueue with "
    "serializer=rq.serializers.JSONSerializer (a batcher worker never unpickles job data)"
)

EndStatus = Literal["finished", "failed", "stopped", "lost"]


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


@dataclass(eq=False)
class InFlight:
    """A job this worker has started: its RQ objects and the times its result reports."""

    job: Job
    queue: Queue
    execution: Execution
    admitted_at: float  # time.monotonic()
    result_ttl: int
    failure_ttl: int
    timeout_at: float | None = None
    first_token_at: float | None = None
    request: GenerationRequest | None = None  # None while undecoded, or if the job carries no valid request


AddedHook = Callable[["BatchWorker", Sequence], None]
StepHook = Callable[["BatchWorker", list[RequestOutput]], None]
JobEndHook = Callable[["BatchWorker", JobEnd], None]


class BatchWorker(BaseWorker):
    """Serve RQ queues (given most urgent first) with continuous batching on `engine`.

    Hooks for an ops layer, all called on the loop's thread: `on_added` with each sequence the engine
    takes, `on_step` after every engine step, `on_job_end` once per job that ended however it ended.
    `queue_depths` holds the queue lengths as last read."""

    def __init__(self, queues: list[str], engine: Engine, *, connection: Redis, name: str | None = None,
                 model_name: str | None = None, lease_s: int = DEFAULT_LEASE_S, on_added: AddedHook | None = None,
                 on_step: StepHook | None = None, on_job_end: JobEndHook | None = None) -> None:
        if lease_s < 1:
            raise ValueError(f"lease_s must be at least 1 second, got {lease_s}")
        # redis-py re-sends a command (a whole MULTI pipeline too) whose reply was lost, so a write that did
        # happen could happen twice: a job's Result recorded twice, a job requeued twice. This worker retries
        # at its own level instead (work's backoff; an unrecorded job's lease runs out and it is retried).
        connection.set_retry(Retry(NoBackoff(), 0))
        wait_for_redis(connection)  # RQ's own __init__ talks to Redis
        super().__init__(list(queues), name=name, connection=connection, serializer=JSONSerializer,
                         maintenance_interval=DEFAULT_MAINTENANCE_INTERVAL_S)
        self.engine = engine
        self.model_name = model_name or engine.loaded.name  # the name jobs use to route to this worker
        self._recording: tuple[InFlight, JobEnd] | None = None  # the end RQ's handler is writing now
        self.lease_s = int(lease_s)
        self.on_added, self.on_step, self.on_job_end = on_added, on_step, on_job_end
        self.streams = StreamWriter(connection)
        self.jobs_taken = 0
        self.tokens_generated = 0
        self.queue_depths: dict[str, int] = {}
        self._rate_mark = (time.monotonic(), 0)  # (when, tokens_generated) at the last stats publication
        self._jobs: dict[str, InFlight] = {}  # by execution id, which is also the engine's request id
        self._ending: list[tuple[InFlight, JobEnd]] = []
        self._end_buffered: set[str] = set()  # execution ids whose end event waits in a flush that failed
        self._stop_requests: set[str] = set()  # job ids, from the pubsub thread
        self._lost: set[str] = set()  # execution ids, from the keeper thread
        self._lock = threading.Lock()  # guards the three collections above across threads
        self._wake = threading.Event()  # cuts an idle wait short (signal, stop-job, lost lease)
        self._keeper_stop = threading.Event()
        self._force_stop = False
        self._suspended = False
        self._queues_empty = False
        self._next_scan = 0.0  # time.monotonic() of the next admission scan while busy

    # ----- what an ops layer reads -----
    @property
    def num_in_flight(self) -> int:
        return len(self._jobs)

    @property
    def in_flight_job_ids(self) -> list[str]:
        with self._lock:
            return [f.job.id for f in self._jobs.values()]

    @property
    def pending_stop_requests(self) -> set[str]:
        """Job ids with a stop-job command not applied yet (it is applied before the next step)."""
        with self._lock:
            return set(self._stop_requests)

    # ----- the loop -----
    def work(self, burst: bool = False, logging_level: str | None = None, **_ignored) -> bool:
        """Serve until drained (first signal or RQ's shutdown command: stop admitting, finish the jobs in
        flight), force-stopped (second signal: requeue them at the front), or, with `burst`, until the
        queues are empty and nothing is in flight. Return whether any job was taken."""
        version = get_version(self.connection)
        if version < MIN_REDIS_VERSION:
            raise RuntimeError(f"batcher needs Redis >= {'.'.join(map(str, MIN_REDIS_VERSION))} (LMOVE); "
                               f"this one is {'.'.join(map(str, version))}")
        self.bootstrap(logging_level or logging.getLevelName(log.getEffectiveLevel()))
        if threading.current_thread() is threading.main_thread():
            self._install_signal_handlers()
        keeper = threading.Thread(target=self._keep_leases, name=f"lease-keeper-{self.name}", daemon=True)
        keeper.start()
        try:
            backoff = 0.0
            while True:
                try:
                    if not self._iterate(burst):
                        break
                    backoff = 0.0
                except REDIS_ERRORS as exc:  # the jobs in flight stay in flight; their ends are kept
                    if self._force_stop:
                        log.error("worker %s: Redis unreachable (%s) while stopping; the leases of %d jobs run out "
                                  "and other workers retry them", self.name, exc, len(self._jobs))
                        raise
                    backoff = min(REDIS_BACKOFF_S[1], max(REDIS_BACKOFF_S[0], 2 * backoff))
                    log.warning("worker %s: Redis unreachable (%s); retrying in %.1f s, %d jobs in flight",
                                self.name, exc, backoff, len(self._jobs))
                    time.sleep(backoff)
        finally:
            self._keeper_stop.set()
            keeper.join()
            self._unpublish_stats()
            self.teardown()
        return self.jobs_taken > 0

    def _iterate(self, burst: bool) -> bool:
        """One admission, one engine step, one stream pipeline; return whether to go on."""
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()  # between handler calls: RQ's maintenance reads self.execution
        self._apply_requests()
        if self._force_stop:
            self._requeue_in_flight()
            return False
        if not self._stop_requested:
            self._admit(block=not burst and not self.engine.has_work() and not self._ending)
        stepped = self.engine.has_work()
        outputs = self.engine.step() if stepped else []
        self._collect(outputs)
        self._end_jobs()
        idle = not self._jobs
        if idle:
            self._set_state(WorkerStatus.SUSPENDED if self._suspended else WorkerStatus.IDLE)
        if stepped and self.on_step is not None:
            self._call_hook(self.on_step, outputs)
        if idle and self._stop_requested:
            log.info("worker %s drained", self.name)
            return False
        return not (idle and burst and self._queues_empty)

    # ----- admission -----
    def _admit(self, block: bool) -> None:
        free = self.engine.free_slots
        if free <= 0 or (self.engine.has_work() and time.monotonic() < self._next_scan):
            return
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.exists(WORKERS_SUSPENDED)
            for queue in self.queues:
                pipe.llen(queue.key)
            suspended, *lengths = pipe.execute()
        self.queue_depths = {queue.name: n for queue, n in zip(self.queues, lengths)}
        self._next_scan = time.monotonic() + BUSY_RESCAN_S
        self._suspended = bool(suspended)
        self._queues_empty = self._suspended or not any(lengths)
        if self._suspended:  # `rq suspend`: admit nothing; the jobs in flight go on
            if block:
                self._wake.wait(IDLE_WAIT_S)
            return
        taken: list[tuple[Job, Queue]] = []
        for queue, length in zip(self.queues, lengths):
            if length and len(taken) < free:
                taken += self._take(queue, min(length, free - len(taken)))
        if not taken and block:
            taken += self._wait_for_job(self.queues[0])
        if taken:
            self._next_scan = 0.0  # there may be more: look again before the next step
            self._start(taken)

    def _take(self, queue: Queue, n: int) -> list[tuple[Job, Queue]]:
        """Up to `n` jobs from one queue: RQ's reliable dequeue (LMOVE into the intermediate list), batched."""
        with self.connection.pipeline(transaction=False) as pipe:
            for _ in range(n):
                pipe.lmove(queue.key, queue.intermediate_queue_key)
            ids = [as_text(job_id) for job_id in pipe.execute() if job_id is not None]
        taken = []
        for job_id, job in zip(ids, self._fetch(ids)):
            if job is None:  # deleted meanwhile, or a hash RQ cannot read: nothing can run it
                self.connection.lrem(queue.intermediate_queue_key, 1, job_id)
            else:
                taken.append((job, queue))
        return taken

    def _fetch(self, job_ids: list[str]) -> list[Job | None]:
        try:
            return self.job_class.fetch_many(job_ids, connection=self.connection, serializer=self.serializer)
        except REDIS_ERRORS:
            raise  # not the jobs' fault: they stay in the intermediate list, which RQ's maintenance requeues
        except Exception:  # one unreadable hash fails the whole batch: read them one by one
            jobs = []
            for job_id in job_ids:
                try:
                    jobs.append(self.job_class.fetch(job_id, connection=self.connection, serializer=self.serializer))
                except REDIS_ERRORS:
                    raise
                except Exception as exc:
                    log.error("dropping job %s: RQ cannot read it: %s", job_id, exc)
                    jobs.append(None)
            return jobs

    def _wait_for_job(self, queue: Queue) -> list[tuple[Job, Queue]]:
        """Block (BLMOVE) on one queue for a job: only one queue can be watched reliably."""
        try:
            got = self.queue_class.dequeue_any([queue], IDLE_WAIT_S, connection=self.connection,
                                               job_class=self.job_class, serializer=self.serializer)
        except DequeueTimeout:
            return []
        except REDIS_ERRORS:
            raise
        except Exception as exc:  # a hash RQ cannot read: nothing can run it
            log.error("dropping job %s: RQ cannot read it: %s", getattr(exc, "job_id", None), exc)
            if getattr(exc, "job_id", None):
                self.connection.lrem(queue.intermediate_queue_key, 1, exc.job_id)
            return []
        return [got] if got else []

    def _start(self, taken: list[tuple[Job, Queue]]) -> None:
        """Start every taken job as its own Execution (one MULTI), then hand it to the engine."""
        with self.connection.pipeline() as pipe:
            executions, stream_exists_at = [], []
            for job, queue in taken:
                executions.append(Execution.create(job, self.lease_s, pipeline=pipe, worker_name=self.name))
                job.prepare_for_execution(self.name, pipeline=pipe)
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                pipe.persist(job.key)  # the queue TTL no longer applies
                stream_exists_at.append(len(pipe))
                pipe.exists(keys.stream_key(job.id))
            replies = pipe.execute()
        self._set_state(WorkerStatus.BUSY)
        admitted_at = time.monotonic()
        for (job, queue), execution, at in zip(taken, executions, stream_exists_at):
            f = InFlight(job, queue, execution, admitted_at, result_ttl=job.get_result_ttl(self.default_result_ttl),
                         failure_ttl=job.failure_ttl if job.failure_ttl is not None else DEFAULT_FAILURE_TTL)
            with self._lock:
                self._jobs[execution.id] = f
            self.jobs_taken += 1
            if replies[at]:  # an earlier attempt wrote a stream: that worker died or the job was requeued
                self.streams.restart(job.id, execution.id, f.result_ttl)
            self.streams.start(job.id, execution.id, f.result_ttl)
            try:
                request = f.request = self._request(job)
                _check_deadline(request)
                seq = self.engine.add(execution.id, request, arrival_time=admitted_at)
                if request.timeout_s is not None:
                    f.timeout_at = admitted_at + request.timeout_s
                if self.on_added is not None:
                    self._call_hook(self.on_added, seq)
            except (InvalidJob, RequestError) as exc:
                self._end(f, "failed", reason=str(exc))
            except Exception as exc:  # one bad job must not take the worker down
                log.exception("job %s could not be admitted", job.id)
                self._end(f, "failed", reason=f"{type(exc).__name__}: {exc}")

    def _request(self, job: Job) -> GenerationRequest:
        try:
            func_name, args, kwargs = job.func_name, job.args, job.kwargs
        except DeserializationError:
            raise InvalidJob(PICKLED_JOB_REASON) from None
        return request_from_job(func_name, args, kwargs)

    # ----- requests from other threads, and running timeouts -----
    def handle_payload(self, message) -> None:
        """RQ commands (pubsub thread). stop-job is taken for any job in flight, not only a 'current' one."""
        try:
            payload = parse_payload(message)
        except (ValueError, KeyError, AttributeError):  # an exception here would end RQ's pubsub thread
            log.warning("worker %s: ignoring a malformed command %r", self.name, message)
            return
        if payload.get("command") == "stop-job":
            with self._lock:
                self._stop_requests.add(str(payload.get("job_id")))
            self._wake.set()
        else:
            handle_command(self, payload)  # shutdown arrives as SIGINT, so it drains

    def _apply_requests(self) -> None:
        with self._lock:
            stops, self._stop_requests = self._stop_requests, set()
            lost, self._lost = self._lost, set()
            self._wake.clear()
        for execution_id in lost:
            f = self._jobs.get(execution_id)
            if f is not None:
                log.warning("job %s: lease lost; another worker runs it now", f.job.id)
                self.engine.abort(execution_id)
                self._ending = [(p, e) for p, e in self._ending if p is not f]  # ended, but not recorded in time
                self.streams.discard(f.job.id)
                self._end_buffered.discard(execution_id)
                self._forget(f, JobEnd(f.job.id, execution_id, f.queue.name, "lost", reason="lease lost"))
        for f in [f for f in self._jobs.values() if f.job.id in stops]:
            out = self.engine.abort(f.execution.id, reason="cancelled")
            if out is not None:
                self._collect([out])
        moment = time.monotonic()
        for f in [f for f in self._jobs.values() if f.timeout_at is not None and moment >= f.timeout_at]:
            out = self.engine.abort(f.execution.id, reason="timeout")  # keeps the partial text
            if out is not None:
                self._collect([out])

    # ----- outputs, streams, results -----
    def _collect(self, outputs: list[RequestOutput]) -> None:
        """Queue each output's stream events; note the jobs that ended."""
        for out in outputs:
            f = self._jobs.get(out.request_id)
            if f is None:
                continue
            try:
                self.tokens_generated += len(out.new_token_ids)
                if out.new_token_ids or out.delta_text:
                    if f.first_token_at is None and out.new_token_ids:
                        f.first_token_at = time.monotonic()
                    self.streams.token(f.job.id, f.execution.id, out.delta_text, out.new_token_ids,
                                       len(out.token_ids) - len(out.new_token_ids))
                if out.error is not None:
                    self._end(f, "failed", reason=f"generation failed: {out.error}")
                elif out.finish_reason == "cancelled":
                    self._end(f, "stopped", result=self._result(f, out), reason="cancelled by a stop-job command")
                elif out.finish_reason is not None:
                    self._end(f, "finished", result=self._result(f, out))
            except Exception as exc:  # one job's processing must not take the others down
                log.exception("job %s: processing an output failed", f.job.id)
                self.engine.abort(out.request_id)
                self._end(f, "failed", reason=f"{type(exc).__name__}: {exc}")

    def _end(self, f: InFlight, status: EndStatus, result: GenerationResult | None = None,
             reason: str | None = None) -> None:
        if not any(pending is f for pending, _ in self._ending):
            self._ending.append((f, JobEnd(f.job.id, f.execution.id, f.queue.name, status, result, reason)))

    def _end_jobs(self) -> None:
        """Check the leases of the jobs that ended, write the stream events, then record the results:
        a reader that sees a job finished already finds its last event in the stream.

        If Redis is unreachable (the check or the flush raises), the ended jobs stay in `_ending`, with
        their leases kept by the keeper, and the next call tries again: each end event is buffered once,
        and the buffer outlives a failed flush."""
        ending = self._ending
        held = self._leases_held([f for f, _ in ending]) if ending else []
        for i, ((f, end), ok) in enumerate(zip(ending, held)):
            if not ok:
                log.warning("job %s: lease lost before its end was recorded; another worker runs it now", f.job.id)
                self.streams.discard(f.job.id)
                self._end_buffered.discard(f.execution.id)
                ending[i] = (f, JobEnd(f.job.id, f.execution.id, f.queue.name, "lost", reason="lease lost"))
                continue
            if f.execution.id in self._end_buffered:
                continue
            if end.status == "failed":
                self.streams.error(f.job.id, f.execution.id, end.reason, f.failure_ttl)
            else:
                ttl = f.result_ttl if end.status == "finished" else f.failure_ttl
                self.streams.done(f.job.id, f.execution.id, end.result.finish_reason, end.result.usage, ttl)
            self._end_buffered.add(f.execution.id)
        self.streams.flush(force=bool(ending))
        self._ending = []
        for f, end in ending:
            self._end_buffered.discard(f.execution.id)
            if end.status != "lost":
                try:
                    self._record(f, end)
                except Exception:  # e.g. Redis went away: the lease runs out and the job is retried
                    log.exception("job %s: recording its end failed", f.job.id)
            self._forget(f, end)

    def _leases_held(self, ended: list[InFlight]) -> list[bool]:
        """Whether this worker still holds each job's lease, with a margin: a lease about to expire (or
        expired while Redis was unreachable) may be retried by another worker's cleanup at any moment."""
        with self.connection.pipeline(transaction=False) as pipe:
            for f in ended:
                pipe.zscore(f.queue.started_job_registry.key, f.execution.composite_key)
            valid_from = current_timestamp() + self.lease_s / (2 * HEARTBEATS_PER_LEASE)
            return [score is not None and score >= valid_from for score in pipe.execute()]

    def _record(self, f: InFlight, end: JobEnd) -> None:
        """Write the RQ Result and registries through RQ's handlers, one job at a time."""
        job = f.job
        job.ended_at = now()
        self.execution = f.execution
        self._recording = (f, end)
        try:
            if end.status == "finished":
                job._result = end.result.model_dump(mode="json")
                job._status = JobStatus.FINISHED
                self.handle_job_success(job, f.queue, f.queue.started_job_registry)
            else:
                if end.status == "stopped":
                    self._stopped_job_id = job.id  # the handler then marks it stopped, without a retry
                else:
                    job.retries_left = 0  # retries are for lost workers; this request fails the same way again
                job._status = JobStatus.FAILED
                self.handle_job_failure(job, f.queue, f.queue.started_job_registry, exc_string=end.reason)
        finally:
            self.execution = None
            self._stopped_job_id = None
            self._recording = None

    def cleanup_execution(self, job: Job, pipeline) -> None:
        """RQ's handlers call this in the transaction that writes the job's Result: the job's batch line,
        counts and completion-feed entries join that transaction (batcher.batches.record_job_end)."""
        super().cleanup_execution(job, pipeline)
        if self._recording is not None and self._recording[0].job is job:
            f, end = self._recording
            self._recording = None  # once, even if a handler called this twice
            record_job_end(pipeline, job_id=job.id, queue=f.queue.name, status=end.status, request=f.request,
                           result=end.result, reason=end.reason)

    def _forget(self, f: InFlight, end: JobEnd) -> None:
        with self._lock:
            self._jobs.pop(f.execution.id, None)
        if self.on_job_end is not None:
            self._call_hook(self.on_job_end, end)

    def _result(self, f: InFlight, out: RequestOutput) -> GenerationResult:
        ended = time.monotonic()
        job = f.job
        queue_s = (job.started_at - job.enqueued_at).total_seconds() if job.started_at and job.enqueued_at else None
        timings = Timings(queue_s=queue_s, ttft_s=None if f.first_token_at is None else f.first_token_at - f.admitted_at,
                          total_s=ended - f.admitted_at)
        return out.to_result(timings, worker=self.name, model=self.model_name)

    # ----- shutdown -----
    def request_stop(self, signum, frame) -> None:
        """First SIGINT/SIGTERM, or RQ's shutdown command: drain. A second signal force-stops."""
        log.warning("worker %s: draining (stop admitting, finish %d jobs in flight); signal again to requeue them",
                    self.name, len(self._jobs))
        self._stop_requested = True
        self._shutdown_requested_date = now()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.request_force_stop)
            signal.signal(signal.SIGTERM, self.request_force_stop)
        self._wake.set()

    def request_force_stop(self, signum, frame) -> None:
        log.warning("worker %s: stopping now; requeueing %d jobs at the front", self.name, len(self._jobs))
        self._force_stop = True
        self._wake.set()

    def _requeue_in_flight(self) -> None:
        """Put the jobs in flight back at the front of their queues, in their order, without using a retry."""
        in_flight = list(self._jobs.values())
        for f in in_flight:
            self.engine.abort(f.execution.id)
            self.streams.discard(f.job.id)  # the next attempt starts the stream again
        with self.connection.pipeline() as pipe:
            pipe.multi()  # enqueue_job wants the pipeline in MULTI before it is given commands
            for f in reversed(in_flight):
                f.execution.delete(job=f.job, pipeline=pipe)
                f.queue.enqueue_job(f.job, pipeline=pipe, at_front=True)
            pipe.execute()
        with self._lock:
            self._jobs.clear()

    # ----- the lease keeper (its own thread) -----
    def _keep_leases(self) -> None:
        """Extend every in-flight lease and recover the expired leases of dead workers, every lease/3 s."""
        while not self._keeper_stop.wait(self.lease_s / HEARTBEATS_PER_LEASE):
            try:
                self._extend_leases()
                self._recover_expired()
            except Exception:  # Redis unreachable for a moment: try again next tick
                log.exception("worker %s: lease keeping failed", self.name)

    def _extend_leases(self) -> None:
        with self._lock:
            in_flight = list(self._jobs.values())
        with self.connection.pipeline(transaction=False) as pipe:
            self.heartbeat(pipeline=pipe)
            try:
                self._publish_stats(pipe)
            except Exception:  # the figures are for people; the leases must be extended regardless
                log.exception("worker %s: could not gather its stats", self.name)
            score_at, old_score_at = [], []
            for f in in_flight:
                registry = f.queue.started_job_registry
                old_score_at.append(len(pipe))
                pipe.zscore(registry.key, f.execution.composite_key)
                f.execution.heartbeat(registry, self.lease_s, pipeline=pipe)  # ZADD XX: never revives a lost lease
                score_at.append(len(pipe))
                pipe.zscore(registry.key, f.execution.composite_key)
            checked_at = current_timestamp()
            replies = pipe.execute()
        # Lost: gone from the registry, or expired before this heartbeat (after Redis was unreachable for
        # longer than a lease): another worker's cleanup may be retrying it already, so it is not revived.
        lost = {f.execution.id for f, at, old_at in zip(in_flight, score_at, old_score_at)
                if replies[at] is None or (replies[old_at] or 0) < checked_at}
        if lost:
            with self._lock:
                self._lost |= lost
            self._wake.set()

    def _recover_expired(self) -> None:
        """Run RQ's started-registry cleanup on each queue with an expired lease: it retries those jobs.

        RQ itself runs it every 10 minutes; a dead worker's jobs must come back within seconds."""
        with self.connection.pipeline(transaction=False) as pipe:
            for queue in self.queues:
                pipe.zrangebyscore(queue.started_job_registry.key, 0, current_timestamp(), start=0, num=1)
            expired = pipe.execute()
        for queue, hit in zip(self.queues, expired):
            if hit:
                with self._maintenance_lock(queue) as held:
                    if held:
                        log.info("worker %s: recovering jobs with expired leases on %s", self.name, queue.name)
                        queue.started_job_registry.cleanup()

    def _publish_stats(self, pipe) -> None:
        """The figures `batcher workers` shows, refreshed with every heartbeat; they expire with a dead worker."""
        moment, tokens = time.monotonic(), self.tokens_generated
        since, before = self._rate_mark
        self._rate_mark = (moment, tokens)
        if self._stop_requested:
            state = "draining"
        elif self._suspended:
            state = "suspended"
        else:
            state = "busy" if self._jobs else "idle"
        bases = sorted({keys.base_queue(q.name) for q in self.queues})
        key = keys.worker_stats_key(self.name)
        pipe.hset(key, mapping={
            "name": self.name, "host": socket.gethostname(), "pid": os.getpid(), "queues": ",".join(bases),
            "model": self.model_name, "state": state, "in_flight": len(self._jobs),
            "free_slots": self.engine.free_slots, "kv_usage": round(self.engine.kv_cache_usage, 4),
            "tokens_per_s": round((tokens - before) / max(moment - since, 1e-9), 2),
            "last_heartbeat": time.time(),
        })
        pipe.expire(key, STATS_TTL_LEASES * self.lease_s)
        pipe.sadd(keys.WORKERS_SET, self.name)

    def _unpublish_stats(self) -> None:
        try:
            with self.connection.pipeline() as pipe:
                pipe.delete(keys.worker_stats_key(self.name))
                pipe.srem(keys.WORKERS_SET, self.name)
                pipe.execute()
        except Exception:  # Redis gone at exit: the hash expires on its own
            log.warning("worker %s: could not remove its stats from Redis", self.name)

    def clean_registries(self) -> None:
        """RQ's periodic maintenance (run_maintenance_tasks calls it), under a lock that expires in one lease.

        RQ's own lock lasts 15 minutes if its holder dies, and would stall every worker's recovery."""
        for queue in self.queues:
            with self._maintenance_lock(queue) as held:
                if held:
                    clean_registries(queue, self._exc_handlers)
                    worker_registration.clean_worker_registry(queue)
                    queue.intermediate_queue.cleanup(self, queue)
        self.last_cleaned_at = now()

    @contextmanager
    def _maintenance_lock(self, queue: Queue) -> Iterator[bool]:
        """RQ's per-queue cleaning lock: one cleaner at a time across workers and threads, so no expired
        job is retried twice."""
        held = bool(self.connection.set(queue.registry_cleaning_key, self.name, nx=True, ex=self.lease_s))
        try:
            yield held
        finally:
            if held:
                queue.release_maintenance_lock()

    # ----- small helpers -----
    def _set_state(self, state: WorkerStatus) -> None:
        if self.get_state() != state:
            self.set_state(state)

    def _call_hook(self, hook: Callable, arg) -> None:
        try:
            hook(self, arg)
        except Exception:  # an ops hook must not stop the jobs
            log.exception("worker %s: hook %r failed", self.name, hook)


def _check_deadline(request: GenerationRequest) -> None:
    if request.deadline is not None:
        deadline = request.deadline if request.deadline.tzinfo else request.deadline.replace(tzinfo=timezone.utc)
        if datetime.now(timezone.utc) > deadline:
            raise InvalidJob(f"the deadline {deadline.isoformat()} passed while the job was queued")


def wait_for_redis(connection: Redis) -> None:
    """Return once Redis answers; until then, say so and retry with backoff (a worker may start first)."""
    delay = REDIS_BACKOFF_S[0]
    while True:
        try:
            connection.ping()
            return
        except REDIS_ERRORS as exc:
            kwargs = connection.connection_pool.connection_kwargs
            where = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
            log.warning("cannot reach Redis at %s (%s); retrying in %.1f s", where, exc, delay)
            time.sleep(delay)
            delay = min(REDIS_BACKOFF_S[1], 2 * delay)


def embedded_redis() -> Redis:
    """An in-process Redis (fakeredis) that threads of this process share, for demos.

    fakeredis answers no INFO, so RQ is told the server version it would otherwise ask for."""
    import fakeredis

    connection = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    setattr(connection, "__rq_redis_server_version", (7, 2, 0))
    return connection
