"""Service classes: how urgent a job is. The vocabulary the scheduler, the job system and the OpenAI formats share.

Three classes, most urgent first: `priority`, `interactive` (the default for a single request, however it was
enqueued: the gateway, `Client.submit`, `batcher submit`, a plain-RQ enqueue to a queue) and `batch` (the lines
of a batch, and a single request with OpenAI's `service_tier: "flex"`). Within a class, the priority levels
0-9 order the work (0 first). A free slot goes to the most urgent waiting work:

    priority level 0 ... 9, then interactive level 0 ... 9, then batch level 0 ... 9

Each class has its own RQ queues (`rqbatcher.jobs.queues`); OpenAI's service tiers map onto the classes
(`rqbatcher.openai.service_tiers`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Literal

PRIORITY, INTERACTIVE, BATCH = "priority", "interactive", "batch"
CLASSES = (PRIORITY, INTERACTIVE, BATCH)  # most urgent first
RANK = {name: rank for rank, name in enumerate(CLASSES)}
ServiceClass = Literal["priority", "interactive", "batch"]

# A batch line whose batch has less than this left is due: the pick takes it before other batch work, as urgent
# work (`rqbatcher.jobs.fairness`), and the engine runs it at interactive urgency, never preempting it for
# interactive work.
DEADLINE_BOOST_S = 15 * 60


def class_of(request) -> str:
    """The class a GenerationRequest runs in: its own, else batch for a batch line and interactive otherwise."""
    if request.service_class is not None:
        return request.service_class
    return BATCH if request.batch is not None else INTERACTIVE


def urgency_of(request, now: datetime | None = None) -> tuple[int, int]:
    """(class rank, priority level) of a request in the engine, lower first; a batch line whose window closes
    within DEADLINE_BOOST_S runs at interactive rank."""
    service_class = class_of(request)
    rank = RANK[service_class]
    if service_class == BATCH and request.deadline is not None:
        if (request.deadline - (now or datetime.now(timezone.utc))).total_seconds() < DEADLINE_BOOST_S:
            rank = RANK[INTERACTIVE]
    return rank, request.priority
