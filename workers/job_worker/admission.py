"""Admission: while the engine has room, take jobs from the queues (most urgent class first, fairly between
tenants: `rqbatcher.workers.job_worker.class_pick`) and start them.

Each taken job moves into its queue's intermediate list, as RQ's reliable dequeue moves it, is fetched,
started as its own RQ Execution under a lease (one transaction for all jobs taken together), decoded, checked
against its deadline and its cancel flag, and handed to the engine. A job that cannot run ends at once with a
readable reason. A busy worker rescans the queues at most every BUSY_RESCAN_S while its room stays the same (a
slot that frees is filled on the next step), and runs the pick only where one EXISTS finds a job in any of them;
an idle one waits on Redis until any of its queues has work, or a new class queue of its bases is registered
(without taking anything: `BaseJobWorker.wait_for_work`), then picks.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from rqbatcher.jobs import keys
from rqbatcher.jobs.ends import TERMINAL_STATUSES
from rqbatcher.jobs.life import InvalidJob, decode_request
from rqbatcher.jobs.redis_retry import REDIS_ERRORS
from rqbatcher.jobs.rq_adapter import WORKERS_SUSPENDED, BaseJobWorker, Execution, Job, Queue, failure_ttl
from rqbatcher.schema import GenerationRequest
from rqbatcher.tools.calls import answer_format
from rqbatcher.workers.engine.api import EngineProtocol, RequestError
from rqbatcher.workers.job_worker.class_pick import ClassAdmission
from rqbatcher.workers.job_worker.in_flight import InFlight, InFlightJobs
from rqbatcher.workers.job_worker.leases import claim_on, fenced
from rqbatcher.workers.job_worker.resume import Resumed, read_resumable, with_job_seed
from rqbatcher.workers.job_worker.stream_writer import StreamWriter

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1  # the longest an idle worker blocks on Redis (or waits while suspended)
BUSY_RESCAN_S = 0.02  # a busy worker that found nothing to admit looks again after this long, not every step
# An idle worker looks at all its queues this often (one EXISTS): what a lone request adds to its time to first
# token on average is half of it, against a few hundred small Redis commands a second per idle worker
IDLE_POLL_S = 0.005
CANCELLED_BEFORE_START = "cancelled before it started"

Taken = tuple[Job, Queue, str]  # a job the pick took, its queue, and the tenant its advance was charged to


class Admission:
    """Takes and starts jobs for one worker; remembers what it last read of the queues."""

    def __init__(self, worker: BaseJobWorker, engine: EngineProtocol, jobs: InFlightJobs,
                 streams: StreamWriter) -> None:
        self.worker, self.engine, self.jobs, self.streams = worker, engine, jobs, streams
        self.classes = ClassAdmission(worker)  # the class and tenant queues, and the fair pick among them
        self.queue_depths: dict[str, int] = {}  # queue lengths, as last read
        self.suspended = False  # `rq suspend` is on, as last read: nothing is admitted
        self.queues_empty = False
        self._next_scan = 0.0  # time.monotonic() of the next scan while busy, unless the engine's room changes
        self._room_scanned: tuple[int, int, int] | None = None  # (free, urgent, fair) room at the last scan

    def admit(self, block: bool) -> list[InFlight]:
        """Take the most urgent jobs the engine has room for (its free slots, and room it would make by preempting
        less urgent work: `workers.job_worker.class_pick`), waiting up to IDLE_WAIT_S for one if `block`; start them
        and return them: each is in the engine, or has already ended."""
        room = (self.engine.free_slots, self.engine.urgent_room, self.engine.fair_room)
        free, extra, fair = room
        if free <= 0 and extra <= 0 and fair <= 0:
            return []
        if self.engine.has_work() and time.monotonic() < self._next_scan and room == self._room_scanned:
            return []  # a scan found nothing for this much room just now
        worker = self.worker
        with worker.connection.pipeline(transaction=False) as pipe:
            pipe.exists(WORKERS_SUSPENDED)
            pipe.exists(*(queue.key for queue in worker.queues))  # an empty list does not exist
            self.classes.read_on(pipe)
            suspended, waiting, *registries = pipe.execute()
        grown = self.classes.update(registries)
        self._next_scan, self._room_scanned = time.monotonic() + BUSY_RESCAN_S, room
        self.suspended = bool(suspended)
        if self.suspended:  # `rq suspend`: admit nothing; the jobs in flight go on
            self.queues_empty = True
            if block:
                self.jobs.wait(IDLE_WAIT_S)
            return []
        if waiting or grown:
            holding = frozenset(f.tenant for f in self.jobs) if fair > 0 else frozenset()  # read only for fair room
            self.queue_depths, picked = self.classes.pick(max(free, 0), extra, self.engine.batch_deficit, fair,
                                                          holding)
        else:  # nothing to take: skip the pick, a script over every queue's keys (a busy scan's main cost)
            self.queue_depths, picked = self.classes.empty_depths(), []
        self.queues_empty = not any(self.queue_depths.values())
        taken: list[Taken] = []
        for queue, ids in picked:
            taken += self._readable(queue, ids)
        registered = {keys.class_queues_key(base): len(names) for base, names in zip(self.classes.bases, registries)}
        if not taken and block and worker.wait_for_work(worker.queues, IDLE_WAIT_S, IDLE_POLL_S, registered):
            self._next_scan = 0.0
            return self.admit(block=False)  # the pick takes what arrived, fairly
        if not taken:
            return []
        self._next_scan = 0.0  # there may be more: look again before the next step
        return self._start(taken)

    def _readable(self, queue: Queue, ids: list[tuple[str, str]]) -> list[Taken]:
        """The jobs RQ can load; an id whose job was deleted meanwhile, or is unreadable, is dropped."""
        jobs = []
        for (job_id, tenant), job in zip(ids, self._fetch([job_id for job_id, _ in ids])):
            if job is None:
                self.worker.drop_taken(queue, job_id)
            else:
                jobs.append((job, queue, tenant))
        return jobs

    def _fetch(self, job_ids: list[str]) -> list[Job | None]:
        worker = self.worker
        try:
            return worker.job_class.fetch_many(job_ids, connection=worker.connection, serializer=worker.serializer)
        except REDIS_ERRORS:
            raise  # not the jobs' fault: they stay in the intermediate list, which recovery requeues
        except Exception:  # one unreadable hash fails the whole batch: read them one by one
            jobs = []
            for job_id in job_ids:
                try:
                    jobs.append(worker.job_class.fetch(job_id, connection=worker.connection,
                                                       serializer=worker.serializer))
                except REDIS_ERRORS:
                    raise
                except Exception as exc:
                    log.error("dropping job %s: RQ cannot read it: %s", job_id, exc)
                    jobs.append(None)
            return jobs

    def _start(self, taken: list[Taken]) -> list[InFlight]:
        """Start every taken job as its own Execution under a lease (one transaction), then hand it to the
        engine. A job another execution holds (a duplicate queue entry) or that already ended is only dropped."""
        worker = self.worker
        started: list[tuple[Job, Queue, str, Execution, int]] = []

        def build(pipe, holders: list[str | None]) -> None:
            started.clear()
            pipe.multi()
            for (job, queue, tenant), holder in zip(taken, holders):
                if holder is not None or job.get_status(refresh=False) in TERMINAL_STATUSES:
                    log.warning("job %s is %s; dropping a duplicate of it from queue %s", job.id,
                                "leased by another execution" if holder else "over", queue.name)
                    worker.drop_taken(queue, job.id, pipe)
                    continue
                execution = worker.start_on(pipe, job, queue)
                claim_on(pipe, job.id, execution.id, queue.name, worker.lease_s)
                started.append((job, queue, tenant, execution, len(pipe)))
                pipe.exists(keys.cancel_key(job.id))
                pipe.xrange(keys.stream_key(job.id))  # what earlier attempts streamed: empty on a first attempt

        replies = fenced(worker.connection, [job.id for job, _, _ in taken], build)
        admitted_at = time.monotonic()
        admitted = []
        for job, queue, tenant, execution, at in started:
            f = InFlight(job, queue, execution, admitted_at, worker.result_ttl(job), failure_ttl(job), tenant)
            cancelled, streamed = replies[at], replies[at + 1]
            unreadable = _decode(f)
            # what earlier attempts streamed, to go on from (None: a first attempt, or a stream that cannot go on)
            resumed = None if not streamed or unreadable else read_resumable(
                streamed, f.request.sampling.logprobs is not None)
            f.chat_format = None if unreadable else answer_format(f.request, self.engine.chat_format)
            self.streams.begin(job.id, execution.id, streamed[-1][0] if streamed else None, f.result_ttl, resumed,
                               f.chat_format)
            admitted.append(f)
            if unreadable is not None:
                f.ended("failed", reason=unreadable)
            else:
                self._hand_over(f, cancelled, resumed)
        return admitted

    def _hand_over(self, f: InFlight, cancelled: bool, resumed: Resumed | None) -> None:
        """Add a started job's request to the engine (going on from what earlier attempts streamed, if any); or end
        it at once with the reason it cannot run."""
        try:
            request = f.request
            if cancelled:
                f.ended("stopped", reason=CANCELLED_BEFORE_START)
                return
            _check_deadline(request)
            self.engine.add(f.id, with_job_seed(request, f.job.id), arrival_time=f.admitted_at,
                            progress=resumed.progress if resumed else None)
            if resumed is not None and resumed.progress:
                log.info("job %s goes on from the %d tokens its stream holds", f.job.id,
                         sum(len(p.token_ids) for p in resumed.progress.values()))
            if request.timeout_s is not None:
                f.timeout_at = f.admitted_at + request.timeout_s
        except (InvalidJob, RequestError) as exc:
            f.ended("failed", reason=str(exc))
        except Exception as exc:  # one bad job must not take the worker down
            log.exception("job %s could not be admitted", f.job.id)
            f.ended("failed", reason=f"{type(exc).__name__}: {exc}")


def _decode(f: InFlight) -> str | None:
    """Decode a started job's request into `f.request`; the reason it cannot run if it cannot be read."""
    try:
        f.request = decode_request(f.job)
    except InvalidJob as exc:
        return str(exc)
    except Exception as exc:  # one bad job must not take the worker down
        log.exception("job %s could not be decoded", f.job.id)
        return f"{type(exc).__name__}: {exc}"
    return None


def _check_deadline(request: GenerationRequest) -> None:
    if request.deadline is not None and datetime.now(timezone.utc) > request.deadline:
        raise InvalidJob(f"the deadline {request.deadline.isoformat()} passed while the job was queued")
