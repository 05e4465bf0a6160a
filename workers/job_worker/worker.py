"""JobWorker: an RQ worker that keeps many generation jobs in flight on one engine.

Its own loop replaces RQ's one-job-at-a-time `work()`. Each iteration:
- acts on what other threads asked (stop-job commands, lost leases) and on running timeouts;
- admits jobs while the engine has free slots (`rqbatcher.workers.job_worker.admission`);
- steps the engine once and queues every sequence's stream events (`workers.job_worker.stream_writer` writes them in one
  fenced script call);
- records the ends of the jobs that ended (`workers.job_worker.job_ends`): last stream events, result and lease release
  in one transaction, which Redis applies only while this worker still holds the lease.

Who owns what: the in-flight jobs and every cross-thread flag are in `workers.job_worker.in_flight`; the lease keeper
(`workers.job_worker.leases`) renews leases from a thread of its own, whatever the engine is doing, and recovers the
jobs of dead workers; RQ's side is `rqbatcher.jobs.rq_adapter`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rqbatcher.jobs.connection import describe
from rqbatcher.jobs.contract import DEFAULT_LEASE_S
from rqbatcher.jobs.redis_retry import REDIS_ERRORS, Backoff, retry_while_unreachable
from rqbatcher.jobs.rq_adapter import BaseJobWorker, WorkerStatus, get_version
from rqbatcher.schema import GenerationResult, Timings
from rqbatcher.workers.engine.api import EngineProtocol, RequestOutput
from rqbatcher.workers.job_worker.admission import Admission
from rqbatcher.workers.job_worker.in_flight import InFlight, InFlightJobs, JobEnd
from rqbatcher.workers.job_worker.job_ends import record_ends, requeue
from rqbatcher.workers.job_worker.leases import LeaseKeeper
from rqbatcher.workers.job_worker.stats_publisher import StatsPublisher
from rqbatcher.workers.job_worker.stream_writer import StreamWriter

log = logging.getLogger(__name__)

DEFAULT_MAINTENANCE_INTERVAL_S = 60  # RQ's full registry maintenance (intermediate lists, dead workers)
MIN_REDIS_VERSION = (6, 2, 0)  # LMOVE, which RQ's reliable dequeue needs
# A Redis that stops answering (a partition, a frozen server) must not hang the worker: every command gives up
# after this long, longer than the longest blocking read (admission's IDLE_WAIT_S), and the loop backs off.
SOCKET_TIMEOUT_S = 5.0

StepHook = Callable[["JobWorker", list[RequestOutput]], None]
JobEndHook = Callable[["JobWorker", JobEnd], None]


class JobWorker(BaseJobWorker):
    """Serve RQ queues (given most urgent first) with continuous batching on `engine`.

    Hooks for an ops layer, both called on the loop's thread: `on_step` after every engine step, `on_job_end`
    once per job that ended however it ended."""

    def __init__(self, queues: list[str], engine: EngineProtocol, *, connection: Redis, name: str | None = None,
                 model_name: str | None = None, lease_s: int = DEFAULT_LEASE_S, on_step: StepHook | None = None,
                 on_job_end: JobEndHook | None = None) -> None:
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
        self.model_name = model_name or engine.loaded.name  # the name jobs give to be routed here
        self.on_step, self.on_job_end = on_step, on_job_end
        self.jobs = InFlightJobs()
        self.streams = StreamWriter(connection)
        self.admission = Admission(self, engine, self.jobs, self.streams)
        self.stats = StatsPublisher(self)
        self.keeper = LeaseKeeper(self, in_flight=self.jobs.snapshot, on_beat=self._beat,
                                  on_lost=self.jobs.mark_lost, on_cancelled=self.jobs.mark_cancelled)
        self.jobs_taken = 0
        self.tokens_generated = 0
        self._force_stop = False

    # ----- what an ops layer reads -----
    @property
    def num_in_flight(self) -> int:
        return len(self.jobs)

    @property
    def suspended(self) -> bool:
        """`rq suspend` is on, as this worker last read it: it admits nothing."""
        return self.admission.suspended

    @property
    def queue_depths(self) -> dict[str, int]:
        """The queue lengths, as last read."""
        return self.admission.queue_depths

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
                                  "and other workers retry them", self.name, exc, len(self.jobs))
                        raise
                    delay = backoff.next()
                    log.warning("worker %s: Redis unreachable (%s); retrying in %.1f s, %d jobs in flight",
                                self.name, exc, delay, len(self.jobs))
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
            self._admit(block=not burst and not self.engine.has_work() and not self.jobs.ended())
        stepped = self.engine.has_work()
        outputs = self.engine.step() if stepped else []
        self._collect(outputs)
        self._end_jobs()
        idle = not self.jobs
        if idle:
            self._set_state(WorkerStatus.SUSPENDED if self.suspended else WorkerStatus.IDLE)
        if stepped and self.on_step is not None:
            self._call_hook(self.on_step, outputs)
        if idle and self.drain_requested:
            log.info("worker %s drained", self.name)
            return False
        return not (idle and burst and self.admission.queues_empty)

    def _admit(self, block: bool) -> None:
        admitted = self.admission.admit(block)
        if admitted:
            self._set_state(WorkerStatus.BUSY)
        for f in admitted:
            for earlier in self.jobs.of_job(f.job.id):
                self._lose(earlier)  # this worker ran the job before its lease ran out: that execution is over
            self.jobs.add(f)
            self.jobs_taken += 1

    # ----- requests from other threads, and running timeouts -----
    def stop_job_requested(self, job_id: str) -> None:
        self.jobs.request_stop(job_id)

    def _apply_requests(self) -> None:
        """Act on lost leases, stop-job commands and running timeouts, before the next step."""
        stops = self.jobs.take_stop_requests()
        for f in self.jobs.lost():
            self._lose(f)
        for f in [f for f in self.jobs if f.job.id in stops] if stops else []:
            self._abort(f, "cancelled")
        moment = time.monotonic()
        for f in [f for f in self.jobs if f.timeout_at is not None and moment >= f.timeout_at]:
            self._abort(f, "timeout")  # keeps the partial text

    def _abort(self, f: InFlight, reason: str) -> None:
        out = self.engine.abort(f.id, reason=reason)
        if out is not None:
            self._collect([out])

    # ----- outputs, streams, results -----
    def _collect(self, outputs: list[RequestOutput]) -> None:
        """Queue each output's stream events; note the jobs that ended."""
        for out in outputs:
            f = self.jobs.get(out.request_id)
            if f is None:
                continue
            try:
                self.tokens_generated += len(out.new_token_ids)
                if out.new_token_ids or out.delta_text:
                    start = len(out.token_ids) - len(out.new_token_ids)
                    self.streams.token(f.id, out.delta_text, out.new_token_ids, start, out.new_logprobs, out.choice,
                                       None if start else out.prompt_usage())
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

    def _end_jobs(self) -> None:
        """Write the buffered stream events, then record the ends of the jobs that ended
        (`rqbatcher.workers.job_worker.job_ends`)."""
        ended = self.jobs.ended()
        for execution_id in self.streams.flush(force=bool(ended), exclude={f.id for f in ended}):
            if (f := self.jobs.get(execution_id)) is not None:
                self._lose(f)
        ended = [f for f in ended if self.jobs.get(f.id) is f]
        if not ended:
            return
        recorded = record_ends(self, self.streams, ended)
        for f in ended:
            if f in recorded:
                self.streams.discard(f.id)
                self._forget(f)
            else:
                self._lose(f)

    def _lose(self, f: InFlight) -> None:
        """Another worker holds the job's lease now: drop it here and record nothing."""
        log.warning("job %s: lease lost; another worker runs it now", f.job.id)
        self.engine.abort(f.id)
        self.streams.discard(f.id)
        f.end = JobEnd(f.job.id, f.id, f.queue.name, "lost", reason="lease lost", request=f.request)
        self._forget(f)

    def _forget(self, f: InFlight) -> None:
        self.jobs.remove(f)
        if self.on_job_end is not None:
            self._call_hook(self.on_job_end, f.end)

    def _result(self, f: InFlight, out: RequestOutput) -> GenerationResult:
        job = f.job
        queue_s = (job.started_at - job.enqueued_at).total_seconds() if job.started_at and job.enqueued_at else None
        ttft_s = None if out.first_token_time is None else out.first_token_time - out.arrival_time
        timings = Timings(queue_s=queue_s, ttft_s=ttft_s, total_s=time.monotonic() - f.admitted_at)
        return out.to_result(timings, self.name, self.model_name, f.chat_format)

    # ----- shutdown -----
    def request_stop(self, signum, frame) -> None:
        """First SIGINT/SIGTERM, or RQ's shutdown command: drain. A second signal force-stops."""
        log.warning("worker %s: draining (stop admitting, finish %d jobs in flight); signal again to requeue them",
                    self.name, len(self.jobs))
        self.mark_draining()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.request_force_stop)
            signal.signal(signal.SIGTERM, self.request_force_stop)
        self.jobs.wake()

    def request_force_stop(self, signum, frame) -> None:
        log.warning("worker %s: stopping now; requeueing %d jobs at the front", self.name, len(self.jobs))
        self._force_stop = True
        self.jobs.wake()

    def _requeue_in_flight(self) -> None:
        in_flight = list(self.jobs)
        self.streams.flush(force=True)  # what was generated is written: the next attempt goes on from it
        for f in in_flight:
            self.engine.abort(f.id)
            self.streams.discard(f.id)
        requeue(self, in_flight)
        self.jobs.clear()

    # ----- small helpers -----
    def _beat(self, pipe) -> None:
        """This worker's own heartbeat and the figures `batcher workers` shows (the lease keeper's thread)."""
        self.heartbeat(pipeline=pipe)
        self.stats.write_on(pipe)

    def _set_state(self, state: WorkerStatus) -> None:
        if self.get_state() != state:
            self.set_state(state)

    def _call_hook(self, hook: Callable, arg) -> None:
        try:
            hook(self, arg)
        except Exception:  # an ops hook must not stop the jobs
            log.exception("worker %s: hook %r failed", self.name, hook)


def wait_for_redis(connection: Redis) -> None:
    """Return once Redis answers; until then, say so and retry with backoff (a worker may start first)."""
    retry_while_unreachable(connection.ping, what=f"Redis at {describe(connection)}")
