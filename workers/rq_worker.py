"""BatchWorker: an RQ worker that keeps many generation jobs in flight on one engine.

Its own loop replaces RQ's one-job-at-a-time `work()`. Each iteration:
- admits: while the engine has free slots, takes jobs from the queues in priority order through RQ's
  reliable dequeue and starts each as its own RQ Execution; it blocks on Redis only when the engine is idle;
- steps the engine once and queues every sequence's stream events (workers/streams.py writes them in
  one pipeline);
- ends the jobs that ended: their last stream events, their result and the release of their lease go in
  one transaction, which Redis applies only while this worker still holds the lease.

Every write of a job is fenced by its lease on the Redis side (`workers.leases`): a worker that lost a
job's lease (cut off from Redis for longer than it) writes nothing more of it. The RQ side lives in
`workers.rq_adapter`; the lease keeper renews the leases from a thread of its own, whatever the engine is
doing, and recovers the jobs of dead workers.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batcher import keys
from batcher.batches import record_job_end
from batcher.jobs import DEFAULT_LEASE_S, InvalidJob, bounded_reason, request_from_job
from batcher.redis_retry import REDIS_ERRORS, Backoff, retry_while_unreachable
from batcher.scheduler import Sequence
from batcher.schema import GenerationRequest, GenerationResult, Timings
from workers.engine_api import EngineProtocol, RequestError, RequestOutput
from workers.leases import LeaseKeeper, claim_on, fenced, release_on
from workers.rq_adapter import (WORKERS_SUSPENDED, BaseBatchWorker, DeserializationError, Execution, Job, Queue,
                                WorkerStatus, get_version)
from workers.stats_publisher import StatsPublisher
from workers.streams import StreamWriter
from workers.urgency import ClassAdmission, charge_end_on

log = logging.getLogger(__name__)

DEFAULT_MAINTENANCE_INTERVAL_S = 60  # RQ's full registry maintenance (intermediate lists, dead workers)
IDLE_WAIT_S = 1  # the longest an idle worker blocks on Redis (or waits while suspended)
BUSY_RESCAN_S = 0.02  # a busy worker that found nothing to admit looks again after this long, not every step
MIN_REDIS_VERSION = (6, 2, 0)  # LMOVE, which RQ's reliable dequeue needs
# A Redis that stops answering (a partition, a frozen server) must not hang the worker: every command gives up
# after this long, longer than the longest blocking read (IDLE_WAIT_S), and the loop backs off and retries.
SOCKET_TIMEOUT_S = 5.0
CANCELLED_BEFORE_START = "cancelled before it started"
TERMINAL_STATUSES = ("finished", "failed", "stopped", "canceled")
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
    """A job this worker has started: its RQ objects, the times its result reports, and how it ended.

    A job that ended keeps its `end` until the end is recorded: if Redis is unreachable meanwhile, the
    keeper keeps its lease and the next iteration tries again; `end_event_buffered` says its last stream
    event already waits in the stream buffer (which outlives a failed flush), so it is written once."""

    job: Job
    queue: Queue
    execution: Execution
    admitted_at: float  # time.monotonic()
    result_ttl: int
    failure_ttl: int
    timeout_at: float | None = None
    first_token_at: float | None = None
    request: GenerationRequest | None = None  # None until decoded, or if the job carries no valid request
    end: JobEnd | None = None
    end_order: int = 0  # jobs that ended in the same iteration are recorded in the order they ended
    end_event_buffered: bool = False
    lease_lost: bool = False  # set by the lease keeper's thread; acted on by the loop

    def ended(self, status: EndStatus, result: GenerationResult | None = None, reason: str | None = None) -> None:
        """Note how the job ended; the first end wins."""
        if self.end is None:
            reason = None if reason is None else bounded_reason(reason)
            self.end = JobEnd(self.job.id, self.execution.id, self.queue.name, status, result, reason)
            self.end_order = next(_END_ORDER)


_END_ORDER = itertools.count()


AddedHook = Callable[["BatchWorker", Sequence], None]
StepHook = Callable[["BatchWorker", list[RequestOutput]], None]
JobEndHook = Callable[["BatchWorker", JobEnd], None]


class BatchWorker(BaseBatchWorker):
    """Serve RQ queues (given most urgent first) with continuous batching on `engine`.

    Hooks for an ops layer, all called on the loop's thread: `on_added` with each sequence the engine
    takes, `on_step` after every engine step, `on_job_end` once per job that ended however it ended.
    `queue_depths` holds the queue lengths as last read."""

    def __init__(self, queues: list[str], engine: EngineProtocol, *, connection: Redis, name: str | None = None,
                 model_name: str | None = None, lease_s: int = DEFAULT_LEASE_S, on_added: AddedHook | None = None,
                 on_step: StepHook | None = None, on_job_end: JobEndHook | None = None) -> None:
        if lease_s < 1:
            raise ValueError(f"lease_s must be at least 1 second, got {lease_s}")
        # redis-py re-sends a command (a whole MULTI pipeline too) whose reply was lost, so a write that did
        # happen could happen twice: a job's Result recorded twice, a job requeued twice. This worker retries
        # at its own level instead (work's backoff; an unrecorded job's lease runs out and it is retried).
        connection.set_retry(Retry(NoBackoff(), 0))
        options = connection.connection_pool.connection_kwargs
        for option in ("socket_timeout", "socket_connect_timeout"):
            if options.get(option) is None:
                options[option] = SOCKET_TIMEOUT_S
        wait_for_redis(connection)  # RQ's own __init__ talks to Redis
        super().__init__(list(queues), connection=connection, name=name, lease_s=int(lease_s),
                         maintenance_interval=DEFAULT_MAINTENANCE_INTERVAL_S)
        self.engine = engine
        self.classes = ClassAdmission(self)
        self.model_name = model_name or engine.loaded.name  # the name jobs give to be routed here
        self.on_added, self.on_step, self.on_job_end = on_added, on_step, on_job_end
        self.streams = StreamWriter(connection)
        self.stats = StatsPublisher(self)
        self.keeper = LeaseKeeper(self, in_flight=self._snapshot, on_beat=self._beat, on_lost=self._leases_lost,
                                  on_cancelled=self._cancelled)
        self.jobs_taken = 0
        self.tokens_generated = 0
        self.queue_depths: dict[str, int] = {}
        self._jobs: dict[str, InFlight] = {}  # by execution id, which is also the engine's request id
        self._stop_requests: set[str] = set()  # job ids, from the pubsub thread
        self._lock = threading.Lock()  # guards `_jobs` and `_stop_requests` across threads
        self._wake = threading.Event()  # cuts an idle wait short (signal, stop-job, lost lease)
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
        return [f.job.id for f in self._snapshot()]

    @property
    def suspended(self) -> bool:
        """`rq suspend` is on, as this worker last read it: it admits nothing."""
        return self._suspended

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
            self.install_signal_handlers()
        self.keeper.start()
        try:
            backoff = Backoff()
            while True:
                try:
                    if not self._iterate(burst):
                        break
                    backoff.reset()
                except REDIS_ERRORS as exc:  # the jobs in flight stay in flight; their ends are kept
                    if self._force_stop:
                        log.error("worker %s: Redis unreachable (%s) while stopping; the leases of %d jobs run out "
                                  "and other workers retry them", self.name, exc, len(self._jobs))
                        raise
                    delay = backoff.next()
                    log.warning("worker %s: Redis unreachable (%s); retrying in %.1f s, %d jobs in flight",
                                self.name, exc, delay, len(self._jobs))
                    time.sleep(delay)
        finally:
            self.keeper.stop()
            self.stats.remove()
            self.teardown()
        return self.jobs_taken > 0

    def _iterate(self, burst: bool) -> bool:
        """One admission, one engine step, one stream pipeline; return whether to go on."""
        if self.should_run_maintenance_tasks:  # at start, then every DEFAULT_MAINTENANCE_INTERVAL_S
            self.run_maintenance_tasks()
            self.keeper.recover_expired()  # the keeper does it every tick too; a burst worker may end before one
        self._apply_requests()
        if self._force_stop:
            self._requeue_in_flight()
            return False
        if not self.drain_requested:
            self._admit(block=not burst and not self.engine.has_work() and not self._ended_jobs())
        stepped = self.engine.has_work()
        outputs = self.engine.step() if stepped else []
        self._collect(outputs)
        self._end_jobs()
        idle = not self._jobs
        if idle:
            self._set_state(WorkerStatus.SUSPENDED if self._suspended else WorkerStatus.IDLE)
        if stepped and self.on_step is not None:
            self._call_hook(self.on_step, outputs)
        if idle and self.drain_requested:
            log.info("worker %s drained", self.name)
            return False
        return not (idle and burst and self._queues_empty)

    # ----- admission -----
    def _admit(self, block: bool) -> None:
        free, extra = self.engine.free_slots, self.engine.urgent_room
        if (free <= 0 and extra <= 0) or (self.engine.has_work() and time.monotonic() < self._next_scan):
            return
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.exists(WORKERS_SUSPENDED)
            self.classes.read_on(pipe)
            suspended, *registries = pipe.execute()
        self.classes.update(registries)
        self._next_scan = time.monotonic() + BUSY_RESCAN_S
        self._suspended = bool(suspended)
        if self._suspended:  # `rq suspend`: admit nothing; the jobs in flight go on
            self._queues_empty = True
            if block:
                self._wake.wait(IDLE_WAIT_S)
            return
        self.queue_depths, picked = self.classes.pick(max(free, 0), extra, self.engine.batch_deficit)
        self._queues_empty = not any(self.queue_depths.values())
        taken: list[tuple[Job, Queue]] = []
        for queue, ids in picked:
            taken += [(job, queue) for job in self._readable(queue, ids)]
        if not taken and block:
            taken += self._wait_for_job(self.queues[0])
        if taken:
            self._next_scan = 0.0  # there may be more: look again before the next step
            self._start(taken)

    def _readable(self, queue: Queue, job_ids: list[str]) -> list[Job]:
        """The jobs RQ can load; an id whose job was deleted meanwhile, or is unreadable, is dropped."""
        jobs = []
        for job_id, job in zip(job_ids, self._fetch(job_ids)):
            if job is None:
                self.drop_taken(queue, job_id)
            else:
                jobs.append(job)
        return jobs

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
        try:
            job = self.wait_for_job(queue, IDLE_WAIT_S)
        except REDIS_ERRORS:
            raise
        except Exception as exc:  # a hash RQ cannot read: nothing can run it
            log.error("dropping job %s: RQ cannot read it: %s", getattr(exc, "job_id", None), exc)
            if getattr(exc, "job_id", None):
                self.drop_taken(queue, exc.job_id)
            return []
        return [(job, queue)] if job else []

    def _start(self, taken: list[tuple[Job, Queue]]) -> None:
        """Start every taken job as its own Execution under a lease (one transaction), then hand it to the
        engine. A job another execution holds (a duplicate queue entry) or that already ended is only dropped."""
        started: list[tuple[Job, Queue, Execution, int]] = []

        def build(pipe, holders: list[str | None]) -> None:
            started.clear()
            pipe.multi()
            for (job, queue), holder in zip(taken, holders):
                if holder is not None or job.get_status(refresh=False) in TERMINAL_STATUSES:
                    log.warning("job %s is %s; dropping a duplicate of it from queue %s", job.id,
                                "leased by another execution" if holder else "over", queue.name)
                    pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                    continue
                execution = self.start_on(pipe, job, queue)
                claim_on(pipe, job.id, execution.id, queue.name, self.lease_s)
                started.append((job, queue, execution, len(pipe)))
                pipe.exists(keys.cancel_key(job.id))
                pipe.xrevrange(keys.stream_key(job.id), count=1)

        replies = fenced(self.connection, [job.id for job, _ in taken], build)
        if started:
            self._set_state(WorkerStatus.BUSY)
        admitted_at = time.monotonic()
        for job, queue, execution, at in started:
            for earlier in [f for f in self._jobs.values() if f.job.id == job.id]:
                self._lose(earlier)  # this worker ran the job before its lease ran out: that execution is over
            f = InFlight(job, queue, execution, admitted_at, self.result_ttl(job), self.failure_ttl(job))
            with self._lock:
                self._jobs[execution.id] = f
            self.jobs_taken += 1
            cancelled, top = replies[at], replies[at + 1]
            self.streams.begin(job.id, execution.id, top[0][0] if top else None, f.result_ttl)
            try:
                request = f.request = self._request(job)
                if cancelled:
                    f.ended("stopped", reason=CANCELLED_BEFORE_START)
                    continue
                _check_deadline(request)
                seq = self.engine.add(execution.id, request, arrival_time=admitted_at)
                if request.timeout_s is not None:
                    f.timeout_at = admitted_at + request.timeout_s
                if self.on_added is not None:
                    self._call_hook(self.on_added, seq)
            except (InvalidJob, RequestError) as exc:
                f.ended("failed", reason=str(exc))
            except Exception as exc:  # one bad job must not take the worker down
                log.exception("job %s could not be admitted", job.id)
                f.ended("failed", reason=f"{type(exc).__name__}: {exc}")

    def _request(self, job: Job) -> GenerationRequest:
        try:
            func_name, args, kwargs = job.func_name, job.args, job.kwargs
        except DeserializationError:
            raise InvalidJob(PICKLED_JOB_REASON) from None
        return request_from_job(func_name, args, kwargs)

    # ----- requests from other threads, and running timeouts -----
    def stop_job_requested(self, job_id: str) -> None:
        with self._lock:
            self._stop_requests.add(job_id)
        self._wake.set()

    def _leases_lost(self, jobs: list[InFlight]) -> None:
        for f in jobs:
            f.lease_lost = True
        self._wake.set()

    def _cancelled(self, jobs: list[InFlight]) -> None:
        """Jobs cancelled while in flight, seen by the keeper: the durable path, when a stop-job command was missed."""
        for f in jobs:
            self.stop_job_requested(f.job.id)

    def _apply_requests(self) -> None:
        """Act on lost leases, stop-job commands and running timeouts, before the next step."""
        with self._lock:
            stops, self._stop_requests = self._stop_requests, set()
            self._wake.clear()
        for f in [f for f in self._jobs.values() if f.lease_lost]:
            self._lose(f)
        for f in [f for f in self._jobs.values() if f.job.id in stops]:
            self._abort(f, "cancelled")
        moment = time.monotonic()
        for f in [f for f in self._jobs.values() if f.timeout_at is not None and moment >= f.timeout_at]:
            self._abort(f, "timeout")  # keeps the partial text

    def _abort(self, f: InFlight, reason: str) -> None:
        out = self.engine.abort(f.execution.id, reason=reason)
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
                    self.streams.token(f.execution.id, out.delta_text, out.new_token_ids,
                                       len(out.token_ids) - len(out.new_token_ids))
                if out.error is not None:
                    f.ended("failed", reason=f"generation failed: {out.error}")
                elif out.finish_reason == "cancelled":
                    f.ended("stopped", self._result(f, out), reason="cancelled by a stop-job command")
                elif out.finish_reason is not None:
                    f.ended("finished", self._result(f, out))
            except Exception as exc:  # one job's processing must not take the others down
                log.exception("job %s: processing an output failed", f.job.id)
                self.engine.abort(out.request_id)
                f.ended("failed", reason=f"{type(exc).__name__}: {exc}")

    def _ended_jobs(self) -> list[InFlight]:
        return sorted((f for f in self._jobs.values() if f.end is not None), key=lambda f: f.end_order)

    def _end_jobs(self) -> None:
        """Write the buffered stream events, then, for each job that ended, its last events, its result and the
        release of its lease in one transaction fenced by its lease: a reader that sees the job ended finds its
        last event in the stream, and a worker that lost the lease writes neither.

        If Redis is unreachable, the ended jobs keep their `end` and the next call tries again; the stream
        buffer outlives a failed write, and an event is never written twice."""
        ended = self._ended_jobs()
        for execution_id in self.streams.flush(force=bool(ended), exclude={f.execution.id for f in ended}):
            if execution_id in self._jobs:
                self._lose(self._jobs[execution_id])
        ended = [f for f in ended if f.execution.id in self._jobs]
        if not ended:
            return
        for f in ended:
            if not f.end_event_buffered:
                self._buffer_end_event(f)
                f.end_event_buffered = True
        recorded: list[InFlight] = []

        def build(pipe, holders: list[str | None]) -> None:
            recorded.clear()
            pipe.multi()
            for f, holder in zip(ended, holders):
                if holder == f.execution.id:
                    self.streams.write_with(pipe, f.execution.id)
                    self._record_on(pipe, f)
                    release_on(pipe, f.job.id, f.execution.id, f.queue.name)
                    recorded.append(f)

        fenced(self.connection, [f.job.id for f in ended], build)
        for f in ended:
            if f in recorded:
                self.streams.discard(f.execution.id)
                self._forget(f)
            else:
                self._lose(f)

    def _buffer_end_event(self, f: InFlight) -> None:
        end = f.end
        if end.status == "failed":
            self.streams.error(f.execution.id, end.reason, f.failure_ttl)
        else:
            ttl = f.result_ttl if end.status == "finished" else f.failure_ttl
            usage = end.result.usage if end.result is not None else None
            reason = "cancelled" if end.result is None else end.result.finish_reason
            self.streams.done(f.execution.id, reason, usage, ttl)

    def _record_on(self, pipe, f: InFlight) -> None:
        """Queue the RQ Result and registries of a job that ended, and its batch line, counts and feed entries."""
        end = f.end
        if end.status == "finished":
            self.success_on(pipe, f.job, f.queue, f.execution, end.result.model_dump(mode="json"))
        else:
            self.failure_on(pipe, f.job, f.queue, f.execution, end.reason, stopped=end.status == "stopped")
        record_job_end(pipe, job_id=f.job.id, queue=f.queue.name, status=end.status, request=f.request,
                       result=end.result, reason=end.reason)
        charge_end_on(pipe, f.queue.name, f.request, end.result)

    def _lose(self, f: InFlight) -> None:
        """Another worker holds the job's lease now: drop it here and record nothing."""
        log.warning("job %s: lease lost; another worker runs it now", f.job.id)
        self.engine.abort(f.execution.id)
        self.streams.discard(f.execution.id)
        f.end = JobEnd(f.job.id, f.execution.id, f.queue.name, "lost", reason="lease lost")
        self._forget(f)

    def _forget(self, f: InFlight) -> None:
        with self._lock:
            self._jobs.pop(f.execution.id, None)
        if self.on_job_end is not None:
            self._call_hook(self.on_job_end, f.end)

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
        self.mark_draining()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.request_force_stop)
            signal.signal(signal.SIGTERM, self.request_force_stop)
        self._wake.set()

    def request_force_stop(self, signum, frame) -> None:
        log.warning("worker %s: stopping now; requeueing %d jobs at the front", self.name, len(self._jobs))
        self._force_stop = True
        self._wake.set()

    def _requeue_in_flight(self) -> None:
        """Put the jobs in flight (still leased by this worker) back at the front of their queues, in their order;
        a requeue does not count as an attempt."""
        in_flight = list(self._jobs.values())
        for f in in_flight:
            self.engine.abort(f.execution.id)
            self.streams.discard(f.execution.id)  # the next attempt starts the stream again

        def build(pipe, holders: list[str | None]) -> None:
            pipe.multi()
            for f, holder in reversed(list(zip(in_flight, holders))):
                if holder == f.execution.id:
                    self.requeue_on(pipe, f.job, f.queue, f.execution)
                    release_on(pipe, f.job.id, f.execution.id, f.queue.name, ended=False)
                    pipe.decr(keys.attempts_key(f.job.id))

        if in_flight:
            fenced(self.connection, [f.job.id for f in in_flight], build)
        with self._lock:
            self._jobs.clear()

    # ----- what the lease keeper's thread calls -----
    def _snapshot(self) -> list[InFlight]:
        with self._lock:
            return list(self._jobs.values())

    def _beat(self, pipe) -> None:
        """This worker's own heartbeat and the figures `batcher workers` shows."""
        self.heartbeat(pipeline=pipe)
        self.stats.write_on(pipe)

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
    kwargs = connection.connection_pool.connection_kwargs
    where = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    retry_while_unreachable(connection.ping, what=f"Redis at {where}")
