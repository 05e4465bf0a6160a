"""Each tenant's limits in the gateway, what a request reserves against them, and what a tenant uses now.

A tenant (an API key, or the open gateway's one tenant OPEN_TENANT) gets the gateway's defaults (`batcher serve
--requests-per-minute` ...), each overridden by the options after its key in the keys file:

    sk-abc  requests-per-minute=60 tokens-per-minute=20000 max-concurrent-requests=4 max-queued-batch-lines=1000

The limits are enforced in Redis by `tenant_admission`, so every gateway of the pool shares them. Requests and tokens
per minute are token buckets (as OpenAI's own limits are: a bucket of a minute's worth, refilled continuously); a
request reserves its prompt's estimate plus the most it may generate (`reserved_tokens`), settled at its end.

This module needs neither starlette nor the server extra: `batcher tenants` reads the limits each gateway publishes
at its start (`publish`) and what each tenant uses now (`usage`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields, replace

from redis import Redis

from rqbatcher.jobs import keys
from rqbatcher.jobs.queues import parse_queue, tenant_token
from rqbatcher.jobs.redis_text import as_text
from rqbatcher.jobs.rq_adapter import rq_queue
from rqbatcher.schema import GenerationRequest
from rqbatcher.service_class import BATCH

OPEN_TENANT = "-"  # the one tenant of a gateway with no API keys (as `batcher queues` shows work of no tenant)
CHARS_PER_TOKEN = 4  # the gateway has no tokenizer: OpenAI's own estimator counts a token per 4 characters
BUCKET_WINDOW_S = 60.0  # a per-minute limit refills its whole bucket in this long
PUBLISHED_LIMITS_TTL_S = 7 * 86400  # the published limits outlive a week without any gateway running, no longer


@dataclass(frozen=True)
class Limits:
    """One tenant's limits; None: no limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_queued_batch_lines: int | None = None

    def overridden_by(self, overrides: Limits) -> Limits:
        return replace(self, **{k: v for k, v in asdict(overrides).items() if v is not None})

    @property
    def on_requests(self) -> bool:
        """Whether any limit applies to generation requests (batch lines have their own)."""
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute,
                                            self.max_concurrent_requests))


LIMIT_OPTIONS = {f.name.replace("_", "-"): f.name for f in fields(Limits)}  # as the keys file and the flags spell them


def parse_limit_options(words: list[str]) -> Limits:
    """The limits given as `name=N` words (the options after a key in the keys file); ValueError saying what is
    wrong, quoting nothing the line holds but an option's name (a misplaced key must not reach a log)."""
    found: dict[str, int] = {}
    for word in words:
        name, equals, value = word.partition("=")
        if name not in LIMIT_OPTIONS:
            raise ValueError(f"after the key, each word is an option, one of {', '.join(LIMIT_OPTIONS)} (as "
                             "requests-per-minute=60)")
        if not equals or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{name} takes a whole number of at least 1, as {name}=60")
        found[LIMIT_OPTIONS[name]] = int(value)
    return Limits(**found)


class TenantLimits:
    """The limits of each tenant: the defaults, overridden per tenant."""

    def __init__(self, defaults: Limits = Limits(), overrides: dict[str, Limits] | None = None) -> None:
        self.defaults = defaults
        self._limits = {tenant: defaults.overridden_by(o) for tenant, o in (overrides or {}).items()}

    def of(self, tenant: str) -> Limits:
        return self._limits.get(tenant, self.defaults)


def tenant_of_state(tenant: str | None) -> str:
    """The tenant a request counts against: its key's, or the open gateway's one tenant."""
    return OPEN_TENANT if tenant is None else tenant


def publish(connection: Redis, table: TenantLimits, tenants: list[str]) -> None:
    """Write the tenants' limits where `batcher tenants` reads them (each gateway does at its start)."""
    with connection.pipeline() as pipe:
        pipe.hset(keys.TENANT_LIMITS, mapping={t: json.dumps(asdict(table.of(t))) for t in tenants})
        pipe.expire(keys.TENANT_LIMITS, PUBLISHED_LIMITS_TTL_S)
        pipe.execute()


def reserved_tokens(request: GenerationRequest) -> int:
    """What a request reserves against tokens per minute: its prompt's tokens (its token ids, else its characters
    / CHARS_PER_TOKEN rounded up) plus the most it may generate (max_tokens for each candidate answer; none for a
    tokenize_only job)."""
    if request.embed is not None:
        return sum(len(item) if isinstance(item, list) else _estimate(item) for item in request.embed)
    if request.prompt_token_ids is not None:
        prompt = len(request.prompt_token_ids)
    elif request.messages is not None:
        prompt = _estimate("".join(m.content or "" for m in request.messages))
    else:
        prompt = _estimate(request.prompt or "")
    return prompt + (0 if request.tokenize_only else request.sampling.max_tokens * request.sampling.candidates)


def _estimate(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def bucket_level(stored: float | None, per_minute: int, elapsed_s: float) -> float:
    """A bucket's level now: what was left `elapsed_s` ago (a missing bucket is full), refilled since."""
    level = per_minute if stored is None else stored
    return min(per_minute, level + max(0.0, elapsed_s) * per_minute / BUCKET_WINDOW_S)


def batch_queue_keys(connection: Redis, queue: str, tenant: str) -> list[str]:
    """The Redis lists of a tenant's batch queues under a base queue (every model and priority level)."""
    token = None if tenant == OPEN_TENANT else tenant_token(tenant)
    names = (as_text(n) for n in connection.smembers(keys.class_queues_key(queue)))
    return sorted(rq_queue(n, connection).key for n in names
                  if parse_queue(n).service_class == BATCH and parse_queue(n).tenant == token)


@dataclass(frozen=True)
class TenantUsage:
    """What a tenant uses now against its limits: the requests and tokens its buckets hold spent (None: no limit,
    so no bucket), its requests in flight, and its batch lines queued (or being created) in one base queue."""

    tenant: str
    limits: Limits
    requests: float | None
    tokens: float | None
    concurrent: int
    queued_batch_lines: int

    def to_dict(self) -> dict:
        return {**asdict(self), "limits": asdict(self.limits)}


def usage(connection: Redis, queue: str = keys.DEFAULT_QUEUE) -> list[TenantUsage]:
    """Every tenant a gateway published limits for, with what it uses now."""
    published = {as_text(t): Limits(**json.loads(v)) for t, v in connection.hgetall(keys.TENANT_LIMITS).items()}
    now = time.time()
    rows = []
    for tenant, limits in sorted(published.items()):
        lists = batch_queue_keys(connection, queue, tenant)
        with connection.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.tenant_buckets_key(tenant), "r", "t", "at")
            pipe.zcount(keys.tenant_slots_key(tenant), now, "+inf")
            pipe.zrangebyscore(keys.tenant_batch_reservations_key(tenant), now, "+inf")
            for key in lists:
                pipe.llen(key)
            (requests, tokens, at), concurrent, reserved, *lengths = pipe.execute()
        elapsed = now - float(at) if at is not None else 0.0

        def spent(stored, per_minute: int | None) -> float | None:
            if per_minute is None:
                return None
            return per_minute - bucket_level(None if stored is None else float(stored), per_minute, elapsed)

        pending = sum(int(as_text(m).rpartition(":")[2]) for m in reserved)
        rows.append(TenantUsage(tenant, limits, spent(requests, limits.requests_per_minute),
                                spent(tokens, limits.tokens_per_minute), concurrent, sum(lengths) + pending))
    return rows
