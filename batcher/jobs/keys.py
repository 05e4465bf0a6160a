"""Every Redis key and queue name that batcher itself writes, in one place.

RQ owns its own keys (`rq:queue:<name>`, `rq:job:<id>`, `rq:wip:<name>`, ...); we reach those only
through RQ's objects. Ids and names that go into a key are checked against a small charset first,
so that a job id can never name (or reach into) another key.
"""

from __future__ import annotations

import hashlib
import re

from rqbatcher.errors import InvalidName

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


def priority_queue_names(bases: list[str] | tuple[str, ...], model: str | None = None) -> list[str]:
    """The RQ queues a worker polls, most urgent first: each base in the given order, its levels 0..9.

    A worker that serves `model` polls, at each level, the base's queue of that model first, then the
    base's own queue (jobs that name no model run on any worker)."""
    routed = [[model_queue(base, model), base] if model is not None else [base] for base in bases]
    return [queue_name(q, p) for qs in routed for p in range(NUM_PRIORITIES) for q in qs]


# ----- model routing: a queue per (base queue, model) -----
MODEL_SEPARATOR = "__"
MODEL_HASH_CHARS = 8
MODEL_QUEUES = "batcher:model-queues"  # hash: model queue name -> the model's name (for `batcher queues`)


def model_queue(base: str, model: str) -> str:
    """The queue base of `base`'s jobs for `model`: `<base>__<slug>-<hash>`.

    Model names (hub ids, paths) have '/' and '.', which queue names cannot: the slug keeps the name
    readable, the hash of the whole name keeps two names with the same slug apart."""
    check_queue(base)
    if not model:
        raise ValueError("a model name is not empty")
    digest = hashlib.sha1(model.encode()).hexdigest()[:MODEL_HASH_CHARS]
    room = MAX_QUEUE_CHARS - len(base) - len(MODEL_SEPARATOR) - MODEL_HASH_CHARS - 1
    if room < 1:
        raise ValueError(f"queue {base!r} is too long to route jobs by model: use at most "
                         f"{MAX_QUEUE_CHARS - len(MODEL_SEPARATOR) - MODEL_HASH_CHARS - 2} characters")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", model.rsplit("/", 1)[-1]).strip("-")[:room] or "model"
    return check_queue(f"{base}{MODEL_SEPARATOR}{slug}-{digest}")


def base_queue(rq_queue: str) -> str:
    """The base queue a producer named, from any RQ queue derived from it (priority level, model, class)."""
    return unprioritised(rq_queue).split(MODEL_SEPARATOR)[0]


def unprioritised(rq_queue: str) -> str:
    """An RQ queue's name without its class and priority suffixes (a base queue, or a model queue): base
    and model queue names have no dot, and every suffix starts with one."""
    return rq_queue.split(".")[0]


# ----- service classes and fairness (batcher/service_class.py, batcher/jobs/fairness.py) -----
CLASS_QUEUES_PREFIX = "batcher:class-queues:"
FAIRNESS_PREFIX = "batcher:vtc:"
JOB_TENANTS_PREFIX = "batcher:job-tenants:"
DUE_PREFIX = "batcher:due:"
WAITING_TENANTS_PREFIX = "batcher:waiting-tenants:"


def class_queues_key(base: str) -> str:
    """Set: the RQ queues of a base's priority and batch classes (one batch queue per tenant), so that
    workers and `batcher queues` find them."""
    return CLASS_QUEUES_PREFIX + check_queue(base)


def fairness_key(base: str, service_class: str) -> str:
    """Hash: tenant -> tokens served (weighted) in one class of a base queue, and the class's virtual time."""
    return f"{FAIRNESS_PREFIX}{check_queue(base)}:{service_class}"


def job_tenants_key(base: str) -> str:
    """Hash: job id -> tenant token, for the queued jobs of a base's shared (priority and interactive) queues that
    name a tenant; the fair pick reads it and forgets a job it takes."""
    return JOB_TENANTS_PREFIX + check_queue(base)


def due_key(rq_queue: str) -> str:
    """Sorted set: the lines queued in one batch queue, by their batch's deadline (unix time): the fair pick takes
    the lines whose window is about to close first."""
    return DUE_PREFIX + rq_queue


def waiting_tenants_key(rq_queue: str, tenant: str | None = None) -> str:
    """Set: the tenants with jobs noted in one shared (priority or interactive) queue; with `tenant`, the list of
    that tenant's jobs there, oldest first. The fair pick takes the oldest job of the least served tenant."""
    return WAITING_TENANTS_PREFIX + rq_queue + ("" if tenant is None else ":" + tenant)


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
CANCEL_TTL_S = 7 * 24 * 3600  # a recorded cancel outlives any wait for a worker; the job's end deletes it


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


# ----- batches (batcher/batches.py) -----
BATCH_PREFIX = "batcher:batch:"
BATCH_ID_PREFIX = "batch_"
BATCH_INDEX = "batcher:batches"  # sorted set of every batch id, by creation time
OWNER_PATTERN = re.compile(r"[A-Za-z0-9_.@-]{1,128}")


def check_batch_id(batch_id: str) -> str:
    if (not isinstance(batch_id, str) or not batch_id.startswith(BATCH_ID_PREFIX)
            or not JOB_ID_PATTERN.fullmatch(batch_id)):
        raise InvalidName(f"not a batch id: {batch_id!r}")
    return batch_id


def check_owner(owner: str) -> str:
    if not isinstance(owner, str) or not OWNER_PATTERN.fullmatch(owner):
        raise InvalidName(f"an owner has 1 to 128 characters from A-Z a-z 0-9 _ . @ -, got {owner!r}")
    return owner


def batch_key(batch_id: str) -> str:
    """The batch's hash: status, counts, timestamps, metadata (the OpenAI Batch object's fields)."""
    return BATCH_PREFIX + check_batch_id(batch_id)


def batch_lines_key(batch_id: str) -> str:
    """Hash: input index -> the job's output or error line, written once (the first outcome wins)."""
    return batch_key(batch_id) + ":lines"


def batch_custom_ids_key(batch_id: str) -> str:
    """List: the custom_id of every input line (JSON), in input order."""
    return batch_key(batch_id) + ":custom_ids"


def batch_owner_index(owner: str) -> str:
    """Sorted set of one owner's batch ids, by creation time (a gateway's tenant lists only its own)."""
    return f"batcher:batches:owner:{check_owner(owner)}"


def batch_job_id(batch_id: str, index: int) -> str:
    """A batch's jobs have ids derived from the batch and the input index: the batch keeps no id list,
    and its jobs are found in a queue or a registry by their common prefix."""
    return f"{check_batch_id(batch_id)}-{index}"


def batch_job_prefix(batch_id: str) -> str:
    return f"{check_batch_id(batch_id)}-"


# ----- the completion feed (batcher/jobs/feed.py) -----
FEED_PREFIX = "batcher:feed:"


def queue_feed_key(base: str) -> str:
    """The stream of every finished job of a base queue (whatever its priority level or model)."""
    return f"{FEED_PREFIX}queue:{check_queue(base)}"


def batch_feed_key(batch_id: str) -> str:
    """The stream of every finished job of one batch."""
    return f"{FEED_PREFIX}{check_batch_id(batch_id)}"


# ----- files uploaded through the gateway (batcher/batches/file_store.py) -----
FILE_PREFIX = "batcher:file:"
FILE_ID_PREFIX = "file-"


def check_file_id(file_id: str) -> str:
    if not isinstance(file_id, str) or not file_id.startswith(FILE_ID_PREFIX) or not JOB_ID_PATTERN.fullmatch(file_id):
        raise InvalidName(f"not a file id: {file_id!r}")
    return file_id


def file_key(file_id: str) -> str:
    """The file's hash: the OpenAI File object's fields and its owner. Written once the upload is whole."""
    return FILE_PREFIX + check_file_id(file_id)


def file_chunks_key(file_id: str) -> str:
    """List: the file's bytes in upload order, in chunks of files.CHUNK_BYTES."""
    return file_key(file_id) + ":chunks"


# ----- webhooks (batcher/webhooks) -----
# A list of events waiting to become delivery jobs: each entry is JSON {"type", "id", "tenant", "created_at"},
# pushed in the same transaction as the end it announces (a batch's, a background response's)
WEBHOOK_OUTBOX = "batcher:webhooks:outbox"
# Sorted set: outbox entries a dispatch has taken, by the time it took them; it removes each in the transaction that
# enqueues the entry's deliveries, and an entry left there longer than a while (its dispatcher died) is taken again
WEBHOOK_OUTBOX_CLAIMED = "batcher:webhooks:outbox:claimed"
WEBHOOK_ENDPOINT_PREFIX = "batcher:webhooks:endpoint:"
WEBHOOK_ENDPOINT_ID_PREFIX = "we_"
WEBHOOK_ENDPOINTS = "batcher:webhooks:endpoints"  # set: every endpoint id (`batcher webhooks list`)
WEBHOOK_TENANT_PREFIX = "batcher:webhooks:tenant:"
WEBHOOK_NO_TENANT = "batcher:webhooks:no-tenant"  # set: the endpoints of an open gateway's work (tenant null)


def check_webhook_endpoint_id(endpoint_id: str) -> str:
    if (not isinstance(endpoint_id, str) or not endpoint_id.startswith(WEBHOOK_ENDPOINT_ID_PREFIX)
            or not JOB_ID_PATTERN.fullmatch(endpoint_id)):
        raise InvalidName(f"not a webhook endpoint id: {endpoint_id!r}")
    return endpoint_id


def webhook_endpoint_key(endpoint_id: str) -> str:
    """String: one endpoint as JSON (tenant, url, events, signing secret, whether private addresses are allowed)."""
    return WEBHOOK_ENDPOINT_PREFIX + check_webhook_endpoint_id(endpoint_id)


def webhook_tenant_key(tenant: str | None) -> str:
    """Set: the endpoint ids of one tenant (None: work that names no tenant, an open gateway's)."""
    return WEBHOOK_NO_TENANT if tenant is None else WEBHOOK_TENANT_PREFIX + check_owner(tenant)


# ----- stored responses of /v1/responses (batcher/gateway/response_records.py) -----
RESPONSE_PREFIX = "batcher:response:"
RESPONSE_ID_RE = re.compile(r"resp_[A-Za-z0-9]{1,64}")  # GenerationRequest.background_response's pattern


def check_response_id(response_id: str) -> str:
    if not isinstance(response_id, str) or not RESPONSE_ID_RE.fullmatch(response_id):
        raise InvalidName(f"not a response id: {response_id!r}")
    return response_id


def response_key(response_id: str) -> str:
    """String: one stored response as JSON (its tenant, request, input items and conversation); the response's
    output is its job's result (`resp_<job id>`), kept as long (batcher/gateway/response_records.py)."""
    return RESPONSE_PREFIX + check_response_id(response_id)


# ----- the gateway's per-tenant limits (batcher/gateway/tenant_limits.py, tenant_admission.py) -----
TENANT_LIMITS = "batcher:tenant-limits"  # hash: tenant -> its limits as JSON, published by each gateway at its start
TENANT_STATE_PREFIX = "batcher:tenant:"


def tenant_buckets_key(tenant: str) -> str:
    """Hash: a tenant's request and token buckets (their levels and when they were last filled); it expires once
    both buckets would be full again, since a missing hash reads as full buckets."""
    return f"{TENANT_STATE_PREFIX}{check_owner(tenant)}:buckets"


def tenant_slots_key(tenant: str) -> str:
    """Sorted set: a tenant's requests in flight (`batcher serve` request ids) by the deadline of their lease."""
    return f"{TENANT_STATE_PREFIX}{check_owner(tenant)}:slots"


def tenant_batch_reservations_key(tenant: str) -> str:
    """Sorted set: a tenant's batches being created (`<id>:<lines>`) by the deadline of their lease: lines that count
    against its queued batch lines until they are in their queues."""
    return f"{TENANT_STATE_PREFIX}{check_owner(tenant)}:batch-reservations"
