"""Which RQ queue holds a job of each service class, and what a queue's name says of its class.

Each class has its own RQ queues, derived from the queue a producer named (`routed`: the base queue, or its
model queue), so jobs stay visible to `rq info` and keep every guarantee of docs/reliability.md:
- interactive: `routed` and `routed.pN`, the names they always had;
- priority: `routed.priority` and `routed.priority.pN`;
- batch: one queue per tenant, `routed.batch-<tenant>` (`routed.batch` without one), and `.pN` levels.
The batch queues of a base are many, so they are registered (`keys.class_queues_key`) for workers and
`batcher queues` to find. Between tenants the worker picks fairly (`rqbatcher.jobs.fairness`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from rqbatcher.jobs import keys
from rqbatcher.service_class import BATCH, CLASSES, INTERACTIVE, PRIORITY, RANK

TENANT_TOKEN_CHARS = 40  # a tenant's part of a queue name; longer (or odd) tenants get a slug and a hash
TENANT_HASH_CHARS = 8
SAFE_TENANT = re.compile(rf"[A-Za-z0-9_-]{{1,{TENANT_TOKEN_CHARS}}}")
NO_TENANT = "-"  # the counter of batch work that names no tenant
CLASS_SEPARATOR = "."
BATCH_TENANT_SEPARATOR = "-"


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
