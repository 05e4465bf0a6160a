"""Every Redis key and queue name that batcher itself writes, in one place.

RQ owns its own keys (`rq:queue:<name>`, `rq:job:<id>`, `rq:wip:<name>`, ...); we reach those only
through RQ's objects. Ids and names that go into a key are checked against a small charset first,
so that a job id can never name (or reach into) another key.
"""

from __future__ import annotations

import re

from batcher.errors import InvalidName

DEFAULT_QUEUE = "batcher"
NUM_PRIORITIES = 10  # GenerationRequest.priority is 0 (most urgent) to 9
PRIORITY_SEPARATOR = ".p"

STREAM_PREFIX = "batcher:stream:"

MAX_QUEUE_CHARS = 64
# RQ's own job id charset: every job RQ can load has a valid stream key.
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]+")
# No dots: a dot only ever starts a priority suffix, so two bases can never share a queue.
QUEUE_PATTERN = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_QUEUE_CHARS}}}")


def check_job_id(job_id: str) -> str:
    """Return `job_id` if it is safe to put in a key; raise InvalidName (a ValueError) otherwise."""
    if not isinstance(job_id, str) or not JOB_ID_PATTERN.fullmatch(job_id):
        raise InvalidName(f"a job id has only the characters A-Z a-z 0-9 _ -, got {job_id!r}")
    return job_id


def check_queue(name: str) -> str:
    """Return the queue base name `name` if it is valid; raise InvalidName (a ValueError) otherwise."""
    if not isinstance(name, str) or not QUEUE_PATTERN.fullmatch(name):
        raise InvalidName(f"a queue name has 1 to {MAX_QUEUE_CHARS} characters from A-Z a-z 0-9 _ -, got {name!r}")
    return name


def queue_name(base: str, priority: int) -> str:
    """The RQ queue that holds `base`'s jobs of one priority: `base` itself for 0, `base.p<N>` for N > 0.

    Priority 0 (the default) keeps the plain name, so `Queue("batcher").enqueue(...)` from a backend
    that already uses RQ lands at the default priority."""
    check_queue(base)
    if not 0 <= priority < NUM_PRIORITIES:
        raise InvalidName(f"priority must be 0 to {NUM_PRIORITIES - 1}, got {priority}")
    return base if priority == 0 else f"{base}{PRIORITY_SEPARATOR}{priority}"


def priority_queue_names(bases: list[str] | tuple[str, ...]) -> list[str]:
    """The RQ queues a worker polls, most urgent first: each base in the given order, its levels 0..9."""
    return [queue_name(base, p) for base in bases for p in range(NUM_PRIORITIES)]


def stream_key(job_id: str) -> str:
    """The Redis stream that carries one job's events (start, token, done, error, restart)."""
    return STREAM_PREFIX + check_job_id(job_id)


WORKER_STATS_PREFIX = "batcher:worker:"
WORKERS_SET = "batcher:workers"  # names of workers that published stats; a dead one's hash expires


def worker_stats_key(name: str) -> str:
    """The hash where a worker publishes its figures with every heartbeat (`batcher workers` reads it)."""
    return WORKER_STATS_PREFIX + name


# ----- leases and cancellation (a worker's hold on a job, and a cancel that outlives any worker) -----
LEASE_PREFIX = "batcher:lease:"
LEASE_INDEX_PREFIX = "batcher:leases:"
ATTEMPTS_PREFIX = "batcher:attempts:"
CANCEL_PREFIX = "batcher:cancel:"


def lease_key(job_id: str) -> str:
    """The lease of a started job: its execution id, expiring unless the worker's keeper renews it.
    Every write of that execution (stream events, the result) is fenced by it on the Redis side."""
    return LEASE_PREFIX + check_job_id(job_id)


def lease_index_key(queue: str) -> str:
    """The leases of one RQ queue by expiry time (member `<job_id>:<execution_id>`): where a worker looks
    for the jobs of dead workers."""
    return LEASE_INDEX_PREFIX + queue


def attempts_key(job_id: str) -> str:
    """How many times a job has been started; a job whose workers keep dying fails after a few."""
    return ATTEMPTS_PREFIX + check_job_id(job_id)


def cancel_key(job_id: str) -> str:
    """Set when a job is cancelled, so that the cancel wins even if no worker hears the stop command."""
    return CANCEL_PREFIX + check_job_id(job_id)
