"""Which RQ queue holds a job of each service class, and what a queue's name says of its class.

Each class has its own RQ queues, derived from the queue a producer named (`routed`: the base queue, or its
model queue), so jobs stay visible to `rq info` and keep every guarantee of docs/reliability.md:
- interactive: `routed` and `routed.pN`, the names they always had;
- priority: `routed.priority` and `routed.priority.pN`;
- batch: one queue per tenant, `routed.batch-<tenant>` (`routed.batch` without one), and `.pN` levels.
The batch queues of a base are many, so they are registered (`keys.class_queues_key`) for workers and
`batcher queues` to find. Between tenants the worker picks fairly (`rqbatcher.jobs.fairness`).

An autoscaler reads one key, so the batch lines of a routed queue, whatever their tenant and level, are also kept in
its backlog (`backlog_key`): every way a job enters a batch queue adds it, in the same transaction, and the start
that takes it out (or the drop, or the cancel) removes it. KEDA's redis scaler counts it (ZCARD) as it counts a list.
RQ's own tools bypass it (`rq requeue` of a failed batch line, a plain RQ enqueue straight into a batch queue): such a
job is counted too few, never too many, until it runs.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from rqbatcher.jobs import keys
from rqbatcher.service_class import BATCH, CLASSES, INTERACTIVE, PRIORITY, RANK

TENANT_TOKEN_CHARS = 40  # a tenant's part of a queue name; longer (or odd) tenants get a slug and a hash
TENANT_HASH_CHARS = 8
SAFE_TENANT = re.compile(rf"[A-Za-z0-9_-]{{1,{TENANT_TOKEN_CHARS}}}")
NO_TENANT = "-"  # the counter of batch work that names no tenant
CLASS_SEPARATOR = "."
BATCH_TENANT_SEPARATOR = "-"
BACKLOG_PREFIX = "batcher:backlog:"
# How long a job counts in a backlog when it has no queue TTL of its own (a job requeued after it started): RQ's
# queue TTL bounds the others. A job that no longer waits but was never removed (its canceller died mid-way) counts
# no longer than that.
BACKLOG_HORIZON_S = 24 * 3600


def tenant_token(tenant: str | None) -> str:
    """A tenant as it appears in a queue name and a fairness counter: itself when it is short and plain."""
    if tenant is None:
        return NO_TENANT
    if SAFE_TENANT.fullmatch(tenant):
        return tenant
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", tenant).strip("-")[:TENANT_TOKEN_CHARS - TENANT_HASH_CHARS - 1]
    return f"{slug or 't'}-{hashlib.sha1(tenant.encode()).hexdigest()[:TENANT_HASH_CHARS]}"


def class_queue(routed: str, service_class: str, level: int, tenant: str | None = None) -> str:
    """The RQ queue of one (routed queue, class, level, tenant); only batch queues are per tenant."""
    if service_class == INTERACTIVE:
        return keys.queue_name(routed, level)
    if service_class not in RANK:
        raise ValueError(f"a service class is one of {', '.join(CLASSES)}, got {service_class!r}")
    name = keys.check_queue(routed) + CLASS_SEPARATOR + service_class
    if service_class == BATCH and tenant is not None:
        name += BATCH_TENANT_SEPARATOR + tenant_token(tenant)
    keys.queue_name(routed, level)  # checks the level
    return name + (f"{keys.PRIORITY_SEPARATOR}{level}" if level else "")


@dataclass(frozen=True)
class QueueClass:
    """What a queue's name says: the queue a producer routed to, the class, the level, the tenant's token."""

    routed: str
    service_class: str
    level: int
    tenant: str | None = None

    @property
    def rank(self) -> int:
        return RANK[self.service_class]


def parse_queue(name: str) -> QueueClass:
    """The class of an RQ queue of batcher's (any other name reads as interactive level 0)."""
    routed, *parts = name.split(CLASS_SEPARATOR)
    service_class, tenant, level = INTERACTIVE, None, 0
    for part in parts:
        if part.startswith("p") and part[1:].isdigit():
            level = int(part[1:])
        elif part == PRIORITY:
            service_class = PRIORITY
        elif part == BATCH or part.startswith(BATCH + BATCH_TENANT_SEPARATOR):
            service_class = BATCH
            tenant = part[len(BATCH) + 1:] or None
    return QueueClass(routed, service_class, level, tenant)


# ----- the backlog an autoscaler reads -----
def backlog_key(routed: str) -> str:
    """Sorted set: the batch lines waiting in every batch queue of a routed queue (the base, or its model queue), by
    the time they stop counting. Only the batch class has one: the other classes' queue names are fixed, and an
    autoscaler reads those lists themselves."""
    return f"{BACKLOG_PREFIX}{keys.check_queue(routed)}:{BATCH}"


def _backlog_of(rq_queue: str) -> str | None:
    parsed = parse_queue(rq_queue)
    return backlog_key(parsed.routed) if parsed.service_class == BATCH else None


def backlog_add_on(pipe, rq_queue: str, jobs: dict[str, int | None]) -> None:
    """Queue, on the transaction that puts jobs into `rq_queue` ({job id: its queue TTL in seconds, or None}), their
    entry in the backlog (nothing for a queue that has none), and the removal of entries past their time."""
    key = _backlog_of(rq_queue)
    if key is None or not jobs:
        return
    now = time.time()
    until = {job_id: now + (ttl if ttl and ttl > 0 else BACKLOG_HORIZON_S) for job_id, ttl in jobs.items()}
    pipe.zremrangebyscore(key, "-inf", now)
    pipe.zadd(key, until)
    pipe.expireat(key, int(max(until.values())) + 1, gt=True)
    pipe.expireat(key, int(max(until.values())) + 1, nx=True)


def backlog_remove_on(pipe, rq_queue: str, job_ids: Iterable[str]) -> None:
    """Queue, on the transaction that takes jobs out of `rq_queue` for good (a start, a drop, a cancel), the removal
    of their backlog entries."""
    key, job_ids = _backlog_of(rq_queue), list(job_ids)
    if key is not None and job_ids:
        pipe.zrem(key, *job_ids)
