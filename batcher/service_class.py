"""Service classes: how urgent a job is, and which RQ queue holds it.

Three classes, most urgent first: `priority`, `interactive` (the default for a single request, however it was
enqueued: the gateway, `Client.submit`, `batcher submit`, a plain-RQ enqueue to a queue) and `batch` (the lines
of a batch, and a single request with OpenAI's `service_tier: "flex"`). Within a class, the priority levels
0-9 order the work (0 first). A free slot goes to the most urgent waiting work:

    priority level 0 ... 9, then interactive level 0 ... 9, then batch level 0 ... 9

Each class has its own RQ queues, derived from the queue a producer named (`routed`: the base queue, or its
model queue), so jobs stay visible to `rq info` and keep every guarantee of docs/reliability.md:
- interactive: `routed` and `routed.pN`, the names they always had;
- priority: `routed.priority` and `routed.priority.pN`;
- batch: one queue per tenant, `routed.batch-<tenant>` (`routed.batch` without one), and `.pN` levels.
The batch queues of a base are many, so they are registered (`keys.class_queues_key`) for workers and
`batcher queues` to find. Between tenants the worker picks fairly (`batcher.fairness`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from batcher import keys

PRIORITY, INTERACTIVE, BATCH = "priority", "interactive", "batch"
CLASSES = (PRIORITY, INTERACTIVE, BATCH)  # most urgent first
RANK = {name: rank for rank, name in enumerate(CLASSES)}
ServiceClass = Literal["priority", "interactive", "batch"]

# OpenAI's service_tier values, and the class each one runs in; an answer echoes the tier of its class.
SERVICE_TIERS = {"auto": INTERACTIVE, "default": INTERACTIVE, "flex": BATCH, "priority": PRIORITY}
TIER_OF_CLASS = {PRIORITY: "priority", INTERACTIVE: "default", BATCH: "flex"}

# A batch line whose batch has less than this left is due: the pick takes it before other batch work, as urgent
# work (`batcher.fairness`), and the engine runs it at interactive urgency, never preempting it for interactive work.
DEADLINE_BOOST_S = 15 * 60

TENANT_TOKEN_CHARS = 40  # a tenant's part of a queue name; longer (or odd) tenants get a slug and a hash
TENANT_HASH_CHARS = 8
SAFE_TENANT = re.compile(rf"[A-Za-z0-9_-]{{1,{TENANT_TOKEN_CHARS}}}")
NO_TENANT = "-"  # the counter of batch work that names no tenant
CLASS_SEPARATOR = "."
BATCH_TENANT_SEPARATOR = "-"


def class_of(request) -> str:
    """The class a GenerationRequest runs in: its own, else batch for a batch line and interactive otherwise."""
    if request.service_class is not None:
        return request.service_class
    return BATCH if request.batch is not None else INTERACTIVE


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


def urgency_of(request, now: datetime | None = None) -> tuple[int, int]:
    """(class rank, priority level) of a request in the engine, lower first; a batch line whose window closes
    within DEADLINE_BOOST_S runs at interactive rank."""
    service_class = class_of(request)
    rank = RANK[service_class]
    if service_class == BATCH and request.deadline is not None:
        if (request.deadline - (now or datetime.now(timezone.utc))).total_seconds() < DEADLINE_BOOST_S:
            rank = RANK[INTERACTIVE]
    return rank, request.priority
