"""The worker's side of its jobs' ends: each end recorded (by `rqbatcher.jobs.ends.record_end`), or the jobs' return
to the queue on a force-stop, with the release of their leases and of their buffered stream events.

Both run as one transaction fenced by the jobs' leases (`workers.job_worker.leases.fenced`): Redis applies it only
while this worker still holds each lease, so a worker that lost a job's lease (cut off from Redis for longer than it)
writes nothing more of it, and another worker's run of the job is never overwritten.
"""

from __future__ import annotations

import logging

from rqbatcher.batches.lines import record_outcome_on
from rqbatcher.jobs import durability, keys
from rqbatcher.jobs.ends import record_end
from rqbatcher.jobs.rq_adapter import BaseJobWorker
from rqbatcher.webhooks.outbox import dispatch_after
from rqbatcher.workers.job_worker.in_flight import InFlight
from rqbatcher.workers.job_worker.leases import fenced, release_on
from rqbatcher.workers.job_worker.stream_writer import StreamWriter

log = logging.getLogger(__name__)


def record_ends(worker: BaseJobWorker, streams: StreamWriter, ended: list[InFlight]) -> list[InFlight]:
    """Record each ended job's last stream events, its end (`rqbatcher.jobs.ends.record_end`) and the release of its
    lease in one transaction; return the jobs it recorded (the others' leases are gone).

    A reader that sees the job ended finds its last event in the stream. If Redis is unreachable, this raises:
    the jobs keep their `end` for the next try, and the stream buffer, which outlives a failed write, writes each
    event once."""
    for f in ended:
        if not f.end_event_buffered:
            ttl = f.result_ttl if f.end.status == "finished" else f.failure_ttl
            streams.end(f.id, f.end.status, f.end.result, f.end.reason, ttl)
            f.end_event_buffered = True
    recorded: list[InFlight] = []

    def build(pipe, holders: list[str | None]) -> None:
        recorded.clear()
        pipe.multi()
        for f, holder in zip(ended, holders):
            if holder == f.id:
                streams.write_with(pipe, f.id)
                end = f.end
                record_end(pipe, f.job, f.queue, end.status, request=f.request, record_outcome=record_outcome_on,
                           result=end.result, reason=end.reason, worker=worker, execution=f.execution,
                           charged_tenant=f.tenant, stream_event=False)
                release_on(pipe, f.job.id, f.id, f.queue.name)
                recorded.append(f)

    replies = fenced(worker.connection, [f.job.id for f in ended], build)
    streams.after_transaction(replies, [f.id for f in recorded])
    if recorded:  # before they are forgotten: a failover now makes the next call record them again
        durability.confirm(worker.connection, f"the end of {len(recorded)} jobs", strict=False)
    if any(f.request is not None and (f.request.batch or f.request.background_response) for f in recorded):
        dispatch_after(worker.connection, "job ends")
    return recorded


def requeue(worker: BaseJobWorker, in_flight: list[InFlight]) -> None:
    """Put jobs in flight (still leased by this worker) back at the front of their queues, in their order; a
    requeue does not count as an attempt."""

    def build(pipe, holders: list[str | None]) -> None:
        pipe.multi()
        for f, holder in reversed(list(zip(in_flight, holders))):
            if holder == f.id:
                worker.requeue_on(pipe, f.job, f.queue, f.execution)
                release_on(pipe, f.job.id, f.id, f.queue.name, ended=False)
                pipe.decr(keys.attempts_key(f.job.id))

    if in_flight:
        fenced(worker.connection, [f.job.id for f in in_flight], build)
