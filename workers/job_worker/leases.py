"""Batcher's leases: a worker's hold on each job it runs, kept and checked on the Redis side.

- The lease of a started job is `keys.lease_key(job)`, holding the execution's id and expiring after the
  worker's lease unless renewed. It is claimed in the transaction that starts the job, renewed by the
  keeper thread only while it still holds that execution's id (a lost lease is never revived), and released
  in the transaction that records the job's end.
- Every write of an execution is fenced by it: stream events through a script that checks it
  (`workers.job_worker.stream_writer`), the result and the force-stop requeue through transactions that WATCH it
  (`fenced`). Redis aborts such a transaction if the key changed or expired in between.
- Recovery: `keys.lease_index_key(queue)` lists the leases by expiry. Every tick, the keeper looks for
  expired ones; for each still indexed whose lease key is gone, it claims the job with SET NX in one script
  (exactly one worker wins, once per execution) and,
  in one transaction, requeues it at the front of its queue, or ends it: stopped if it was cancelled
  meanwhile, failed if it has been started MAX_ATTEMPTS times (a job that keeps killing its workers).
  A job a dead worker had taken from its queue but not started yet (still in RQ's intermediate list after
  STRANDED_GRACE_LEASES leases) goes back to the front of its queue. The job's own RQ `Retry` plays no part, so
  a job enqueued with plain RQ is recovered the same way, and RQ's started registry sees a long lease
  (`rqbatcher.jobs.rq_adapter.RQ_REGISTRY_HORIZON_S`) so that RQ's own cleanup never races.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from redis import Redis
from redis.exceptions import WatchError

from rqbatcher.batches.lines import record_outcome_on
from rqbatcher.jobs import durability, keys
from rqbatcher.jobs.ends import TERMINAL_STATUSES, record_end
from rqbatcher.jobs.life import readable_request
from rqbatcher.jobs.redis_retry import REDIS_ERRORS
from rqbatcher.jobs.redis_text import as_text
from rqbatcher.jobs.rq_adapter import BaseJobWorker, Execution, Job, NoSuchJobError, Queue

log = logging.getLogger(__name__)

HEARTBEATS_PER_LEASE = 3  # keeper ticks per lease: two may be late before a lease runs out
MAX_ATTEMPTS = 3  # starts of one job whose worker was lost each time, before it is failed as a poison job
ATTEMPTS_TTL_S = 7 * 24 * 3600  # the start count of a job outlives any queue wait; it is deleted at the end
RECOVERY_BATCH = 100  # expired leases looked at per queue and tick
MAX_WATCH_RETRIES = 5  # a fenced transaction retried when the keeper renewed one of its leases meanwhile
RECOVERING = "recovering"  # what a lease key holds while a worker recovers its job
CANCELLED_WHILE_LOST = "cancelled while its worker was lost"
# A job taken (moved to the intermediate list) is started within milliseconds; one still there this many leases
# later was taken by a worker that died before starting it.
STRANDED_GRACE_LEASES = 2

# KEYS: per job, its lease key and its queue's lease index. ARGV: the lease in ms, then per job: the execution
# id and the index member. Renews the leases still held, by the server's clock; returns the positions (1-based)
# of the others.
RENEW_LUA = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local lost = {}
for j = 1, #KEYS, 2 do
  local i = (j + 1) / 2
  if redis.call('GET', KEYS[j]) == ARGV[2 * i] then
    redis.call('PEXPIRE', KEYS[j], ARGV[1])
    redis.call('ZADD', KEYS[j + 1], expiry, ARGV[2 * i + 1])
  else
    table.insert(lost, i)
  end
end
return lost
"""


# KEYS: the lease key, the queue's lease index. ARGV: the index member, the sentinel, the lease in ms.
# Claims a job whose lease expired for recovery: only if its execution is still indexed (no one recovered it
# yet) and no lease is held (the entry was not merely late), so exactly one worker recovers one execution.
CLAIM_LUA = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) and redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[3]) then
  return 1
end
return 0
"""


def index_member(job_id: str, execution_id: str) -> str:
    return f"{job_id}:{execution_id}"


def claim_on(pipe, job_id: str, execution_id: str, queue: str, lease_s: int) -> None:
    """Queue, in the transaction that starts a job, its lease and its start count."""
    pipe.set(keys.lease_key(job_id), execution_id, px=lease_s * 1000)
    pipe.zadd(keys.lease_index_key(queue), {index_member(job_id, execution_id): (time.time() + lease_s) * 1000})
    pipe.incr(keys.attempts_key(job_id))
    pipe.expire(keys.attempts_key(job_id), ATTEMPTS_TTL_S)


def release_on(pipe, job_id: str, execution_id: str, queue: str, ended: bool = True) -> None:
    """Queue the release of a job's lease; once it `ended`, its start count and cancel flag go too."""
    pipe.delete(keys.lease_key(job_id))
    pipe.zrem(keys.lease_index_key(queue), index_member(job_id, execution_id))
    if ended:
        pipe.delete(keys.attempts_key(job_id), keys.cancel_key(job_id))


def fenced(connection: Redis, job_ids: list[str], build: Callable[[object, list[str | None]], None]) -> list:
    """Run one transaction that depends on who holds these jobs' leases.

    `build(pipe, holders)` sees each job's lease holder (an execution id, or None), calls `pipe.multi()` and
    queues its commands; Redis runs them only if no lease changed (or expired) since it was read. When the
    keeper's renewal got in between, it is tried again. Returns the transaction's replies."""
    lease_keys = [keys.lease_key(job_id) for job_id in job_ids]
    with connection.pipeline() as pipe:
        for attempt in range(MAX_WATCH_RETRIES):
            try:
                pipe.watch(*lease_keys)
                holders = [h.decode() if isinstance(h, bytes) else h for h in pipe.mget(lease_keys)]
                build(pipe, holders)
                return pipe.execute()
            except WatchError:
                if attempt == MAX_WATCH_RETRIES - 1:
                    raise
    raise AssertionError("unreachable")


class Leased(Protocol):
    """A job in flight as the keeper sees it."""

    job: Job
    queue: Queue
    execution: Execution


class LeaseKeeper:
    """Every lease/HEARTBEATS_PER_LEASE seconds, on its own thread (whatever the engine is doing): renews the
    leases of the jobs in flight, reports the ones lost and the ones cancelled, and recovers dead workers' jobs.

    `in_flight()` gives the snapshot; `on_beat(pipe)` adds the worker's own heartbeat to the renewal's pipeline;
    `on_lost(jobs)` and `on_cancelled(jobs)` are called on the keeper's thread."""

    def __init__(self, worker: BaseJobWorker, in_flight: Callable[[], Sequence[Leased]],
                 on_beat: Callable[[object], None], on_lost: Callable[[list[Leased]], None],
                 on_cancelled: Callable[[list[Leased]], None]) -> None:
        self.worker = worker
        self.in_flight, self.on_beat = in_flight, on_beat
        self.on_lost, self.on_cancelled = on_lost, on_cancelled
        self.interval_s = worker.lease_s / HEARTBEATS_PER_LEASE
        self._renew = worker.connection.register_script(RENEW_LUA)
        self._claim = worker.connection.register_script(CLAIM_LUA)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-keeper-{worker.name}", daemon=True)

    def start(self) -> None:
        """Beat once now, on the caller's thread, then every interval on the keeper's: the first beat publishes
        the worker's stats, and until then the gateway answers that no live worker serves its model (lease/3 s
        of 404s after every start)."""
        self.renew([])
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
        """One round: renew every lease of a snapshot, report the lost and cancelled jobs, recover expired ones."""
        jobs = list(self.in_flight())
        lost, cancelled = self.renew(jobs)
        if lost:
            self.on_lost(lost)
        if cancelled:
            self.on_cancelled(cancelled)
        self.recover_expired()

    def renew(self, jobs: list[Leased]) -> tuple[list[Leased], list[Leased]]:
        """Renew the leases of `jobs` (and beat); return those whose lease is gone, and those cancelled."""
        worker = self.worker
        keys_, args = [], [worker.lease_s * 1000]
        with worker.connection.pipeline(transaction=False) as pipe:
            self.on_beat(pipe)
            for job in jobs:
                worker.keep_started_on(pipe, job.queue, job.execution)
                keys_ += [keys.lease_key(job.job.id), keys.lease_index_key(job.queue.name)]
                args += [job.execution.id, index_member(job.job.id, job.execution.id)]
            if jobs:
                self._renew(keys=keys_, args=args, client=pipe)
                pipe.mget([keys.cancel_key(job.job.id) for job in jobs])
            replies = pipe.execute()
        if not jobs:
            return [], []
        lost_at, flags = replies[-2], replies[-1]
        lost = [jobs[i - 1] for i in lost_at]
        return lost, [job for job, flag in zip(jobs, flags) if flag and job not in lost]

    def recover_expired(self) -> int:
        """Recover the jobs whose lease expired, and the jobs a dead worker had taken but not started, on every
        queue of this worker; return how many."""
        connection = self.worker.connection
        seconds, micros = connection.time()
        now_ms = seconds * 1000 + micros // 1000
        recovered = 0
        with connection.pipeline(transaction=False) as pipe:
            for queue in self.worker.queues:
                pipe.zrangebyscore(keys.lease_index_key(queue.name), 0, now_ms, start=0, num=RECOVERY_BATCH)
            expired = pipe.execute()
        for queue, members in zip(self.worker.queues, expired):
            for member in members:
                member = as_text(member)
                recovered += self._recover(queue, *member.split(":", 1))
        for queue, job_ids in self.worker.stranded(self.worker.queues).items():
            recovered += self.worker.requeue_stranded(queue, job_ids, STRANDED_GRACE_LEASES * self.worker.lease_s)
        return recovered

    def _recover(self, queue: Queue, job_id: str, execution_id: str) -> bool:
        """Requeue, or end, one job whose lease expired: only the worker whose SET NX wins does it."""
        worker, connection = self.worker, self.worker.connection
        member = index_member(job_id, execution_id)
        if not self._claim(keys=[keys.lease_key(job_id), keys.lease_index_key(queue.name)],
                           args=[member, RECOVERING, worker.lease_s * 1000]):
            return False  # still leased (its index entry was late), or another worker recovered it already
        attempts, cancelled = connection.mget(keys.attempts_key(job_id), keys.cancel_key(job_id))
        attempts = int(attempts or 1)
        try:
            job = worker.job_class.fetch(job_id, connection=connection, serializer=worker.serializer)
        except NoSuchJobError:  # expired or deleted meanwhile: nothing to run
            with connection.pipeline() as pipe:
                release_on(pipe, job_id, execution_id, queue.name)
                pipe.execute()
            return False
        execution = worker.execution_of(job, execution_id)
        with connection.pipeline() as pipe:
            pipe.multi()
            if job.get_status(refresh=False) in TERMINAL_STATUSES:  # its end was recorded meanwhile: nothing to run
                release_on(pipe, job_id, execution_id, queue.name, ended=False)
                pipe.execute()
                return False
            if cancelled:
                record_end(pipe, job, queue, "stopped", request=readable_request(job), record_outcome=record_outcome_on,
                           reason=CANCELLED_WHILE_LOST, worker=worker, execution=execution)
                outcome = "ended it as cancelled"
            elif attempts >= MAX_ATTEMPTS:
                reason = (f"the job was started {attempts} times, and each time its worker was lost (it crashed, or "
                          "could not reach Redis for longer than its lease); it is not started again, in case it is "
                          "what brings workers down")
                record_end(pipe, job, queue, "failed", request=readable_request(job), record_outcome=record_outcome_on,
                           reason=reason, worker=worker, execution=execution)
                outcome = "failed it as a poison job"
            else:
                worker.requeue_on(pipe, job, queue, execution)
                outcome = "requeued it at the front"
            release_on(pipe, job_id, execution_id, queue.name, ended=bool(cancelled) or attempts >= MAX_ATTEMPTS)
            pipe.execute()
        durability.confirm(connection, f"the recovery of job {job_id}", strict=False)
        log.warning("worker %s: job %s lost its worker (attempt %d); %s", worker.name, job_id, attempts, outcome)
        return True
