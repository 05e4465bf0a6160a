"""What operators do to a running cluster, through RQ's public API and the workers' published stats.

Each function returns plain data; `batcher/cli/admin_commands.py` renders it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from redis import Redis
from rq.suspension import is_suspended, resume, suspend

from rqbatcher.jobs import keys
from rqbatcher.jobs.queues import parse_queue
from rqbatcher.jobs.redis_text import as_text
from rqbatcher.jobs.rq_adapter import Queue, registry_counts, requeue_failed_jobs, rq_queue, shut_down_worker
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.service_class import CLASSES, INTERACTIVE

__all__ = ["WorkerStats", "list_workers", "drain", "suspend_all", "resume_all", "queue_overview",
           "requeue_failed", "is_suspended"]


def list_workers(connection: Redis) -> list[WorkerStats]:
    """Live workers, by name. A worker whose stats expired (it died) is dropped from the index."""
    names = sorted(as_text(n) for n in connection.smembers(keys.WORKERS_SET))
    with connection.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.worker_stats_key(name))
        hashes = pipe.execute()
    live, gone = [], []
    for name, raw in zip(names, hashes):
        if not raw:
            gone.append(name)
            continue
        live.append(WorkerStats.from_hash(raw))
    if gone:
        connection.srem(keys.WORKERS_SET, *gone)
    return live


def drain(connection: Redis, names: list[str]) -> None:
    """Ask each worker to stop admitting, finish its jobs in flight and exit (RQ's shutdown command)."""
    for name in names:
        shut_down_worker(connection, name)


def suspend_all(connection: Redis) -> None:
    """Pause admission on every worker (`rq suspend`); jobs in flight go on."""
    suspend(connection)


def resume_all(connection: Redis) -> None:
    resume(connection)


@dataclass(frozen=True)
class QueueRow:
    """One RQ queue. `model` is the model its jobs name (None: any worker of the base queue runs them);
    `served` says whether a live worker polls it: an unserved queue's jobs wait until one does."""

    queue: str
    queued: int
    started: int
    failed: int
    finished: int
    model: str | None = None
    served: bool = True
    service_class: str = INTERACTIVE
    tenant: str | None = None  # a batch queue's tenant (as its queue name spells it)

    def to_dict(self) -> dict:
        return asdict(self)


def _queues(connection: Redis, queue: str | None) -> list[Queue]:
    if queue is not None:
        names = keys.priority_queue_names([queue]) + sorted(as_text(n) for n in connection.smembers(
            keys.class_queues_key(queue)) if keys.unprioritised(as_text(n)) == queue)
    else:
        names = sorted(q.name for q in Queue.all(connection=connection))
    return [rq_queue(name, connection) for name in names]


def queue_overview(connection: Redis, queue: str | None = None) -> list[QueueRow]:
    """Depth and registry counts of every RQ queue (or of one base queue's priority levels and models),
    with the model each queue routes to and whether a live worker serves it."""
    qs = _queues(connection, queue)
    if queue is not None:  # the base's model queues too
        qs += [q for q in _queues(connection, None) if keys.base_queue(q.name) == queue
               and keys.unprioritised(q.name) != queue]
    models = {k.decode(): v.decode() for k, v in connection.hgetall(keys.MODEL_QUEUES).items()}
    live = list_workers(connection)
    rows = []
    for q in qs:
        base, routed = keys.base_queue(q.name), keys.unprioritised(q.name)
        model = models.get(routed) if routed != base else None
        served = any(base in w.queues.split(",") and (model is None or w.model == model) for w in live)
        parsed = parse_queue(q.name)
        row = QueueRow(q.name, q.count, *registry_counts(q), model, served, parsed.service_class, parsed.tenant)
        if queue is None or q.name == queue or row.queued or row.started or row.failed or row.finished:
            rows.append(row)  # a base queue's empty priority levels would only be noise
    return rows


def class_backlog(rows: list[QueueRow]) -> dict[str, dict[str, int]]:
    """Per service class: jobs queued and started, and how many tenants have jobs queued."""
    backlog = {c: {"queued": 0, "started": 0, "tenants": 0} for c in CLASSES}
    tenants: dict[str, set] = {c: set() for c in CLASSES}
    for row in rows:
        backlog[row.service_class]["queued"] += row.queued
        backlog[row.service_class]["started"] += row.started
        if row.queued:
            tenants[row.service_class].add(row.tenant)
    for c in CLASSES:
        backlog[c]["tenants"] = len(tenants[c])
    return backlog


def requeue_failed(connection: Redis, queue: str | None = None) -> int:
    """Put every failed job (of one base queue, or of all queues) back on its queue; return how many."""
    total = 0
    for q in _queues(connection, queue):
        job_ids = requeue_failed_jobs(q)
        if job_ids:  # run again on purpose: an old cancel must not stop them
            connection.delete(*[keys.cancel_key(job_id) for job_id in job_ids])
        total += len(job_ids)
    return total
