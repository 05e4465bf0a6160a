"""Each tenant's limits enforced in Redis, so that every gateway of the pool shares them (`tenant_limits` holds the
limits themselves).

Requests and tokens per minute are token buckets rather than sliding windows: each holds a minute's worth and
refills continuously, which is how OpenAI describes its own limits, so its `x-ratelimit-remaining-*` (the bucket's
level) and `x-ratelimit-reset-*` (the time until the bucket is full) mean what clients expect; the state is two
numbers and a time per tenant (a sliding log would hold an entry per request), and a request's tokens are settled
at its end by giving the unused part back. A request whose reserve is more than a whole bucket can never pass: it
gets a 429 that tells the SDKs not to retry (`x-should-retry: false`).

Concurrent requests are a sorted set of request ids scored by the deadline of their lease (SLOT_LEASE_S). Each
gateway renews its requests' leases every SLOT_RENEW_S (`keep_leases`) and every check first drops expired ones,
so a gateway killed mid-request holds its slots SLOT_LEASE_S at most. A request holds its slot until its answer's
last byte is sent or its client leaves (a stream until its end; a background response only while its HTTP request
lasts: its job runs on without a slot).

Each check is one Lua script (ADMIT_LUA, one round trip; none for a tenant without limits on requests), and so is
each settlement (SETTLE_LUA, after the answer is sent); a batch's check reads the names of its tenant's batch queues,
then runs one script (RESERVE_BATCH_LUA). Bucket keys expire once the bucket would be full again, slot and
reservation keys with their leases: nothing outlives its use. Times are the gateway's
clock, so the gateways of a pool keep their clocks in step (as NTP does).

Batch creation counts only against max-queued-batch-lines: the tenant's lines queued in the gateway's queue and not
yet run (the lengths of its batch queues) plus the lines of its batches still being created (reserved with a lease
until their lines are in their queues). A batch that would pass the limit is refused whole.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass

import anyio
from prometheus_client import Counter
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rqbatcher.gateway.error_objects import NO_RETRY, ApiError
from rqbatcher.gateway.tenant_limits import (
    BUCKET_WINDOW_S,
    PUBLISHED_LIMITS_TTL_S,
    Limits,
    TenantLimits,
    batch_queue_keys,
    reserved_tokens,
    tenant_of_state,
)
from rqbatcher.jobs import keys
from rqbatcher.schema import GenerationRequest, Usage

log = logging.getLogger(__name__)

SLOT_LEASE_S = 30.0  # how long a dead gateway's requests keep their concurrency slots
SLOT_RENEW_S = 10.0  # how often a gateway renews the leases of its requests in flight
BATCH_LEASE_S = 600.0  # the longest a batch's creation (its lines read and enqueued) is expected to take
BATCH_RETRY_AFTER_S = 60  # how long a refused batch waits: queued lines leave at the pace the workers run them
MIN_RETRY_AFTER_S = 1  # Retry-After is whole seconds, and never 0 (a client would retry at once)
RATE_LIMIT_CODE = "rate_limit_exceeded"
REQUESTS, TOKENS, CONCURRENCY, BATCH_LINES = "requests", "tokens", "concurrency", "batch_lines"  # metric labels
ADMISSION_FIELD = "admission"  # where a request's Admission is kept in its ASGI scope's state
clock = time.time  # the gateway's clock (the gateways of a pool share the buckets, so they share wall time)

# A tenant's buckets: `level(stored, cap)` is a bucket's level now (a missing one is full), `store()` writes both with
# the time and an expiry at the moment both would be full again. KEYS[1] is the buckets' hash, ARGV[1] now (seconds),
# ARGV[2] and ARGV[3] requests and tokens per minute (0: no such limit), ARGV[4] the window (seconds).
BUCKETS_LUA = """
local now, rpm, tpm, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local stored = redis.call('HMGET', KEYS[1], 'r', 't', 'at')
local elapsed = math.max(0, now - tonumber(stored[3] or now))
local function level(v, cap)
  if cap == 0 then return 0 end
  return math.min(cap, tonumber(v or cap) + elapsed * cap / window)
end
local r, t = level(stored[1], rpm), level(stored[2], tpm)
local function store()
  if rpm == 0 and tpm == 0 then return end
  redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(t), 'at', ARGV[1])
  local full = 0
  if rpm > 0 then full = (rpm - r) * window / rpm end
  if tpm > 0 then full = math.max(full, (tpm - t) * window / tpm) end
  redis.call('PEXPIRE', KEYS[1], math.ceil(full * 1000) + 1000)
end
"""

# KEYS[2]: the tenant's slots. ARGV[5]: most concurrent requests (0: no limit), ARGV[6] tokens to reserve, ARGV[7]
# the request's id, ARGV[8] its lease in ms. Returns {refused limit or '', seconds until it would pass, the request
# bucket's level, the token bucket's level, requests in flight}; a refused request changes nothing.
ADMIT_LUA = BUCKETS_LUA + """
local most, cost = tonumber(ARGV[5]), tonumber(ARGV[6])
local held = 0
if most > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  held = redis.call('ZCARD', KEYS[2])
end
local refused, wait = '', 0
if most > 0 and held >= most then refused = 'concurrency'
elseif rpm > 0 and r < 1 then refused, wait = 'requests', (1 - r) * window / rpm
elseif tpm > 0 and t < cost then refused, wait = 'tokens', (cost - t) * window / tpm end
if refused == '' then
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then t = t - cost end
  store()
  if most > 0 then
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[8]) / 1000, ARGV[7])
    redis.call('PEXPIRE', KEYS[2], ARGV[8])
    held = held + 1
  end
end
return {refused, tostring(wait), tostring(r), tostring(t), held}
"""

# ARGV[5]: the request's id in the slots ('' for none), ARGV[6] tokens to give back (negative: to take).
SETTLE_LUA = BUCKETS_LUA + """
if ARGV[5] ~= '' then redis.call('ZREM', KEYS[2], ARGV[5]) end
local back = tonumber(ARGV[6])
if tpm > 0 and back ~= 0 then
  t = math.min(tpm, t + back)
  store()
end
return 1
"""

# KEYS[1]: the tenant's batch reservations, KEYS[2..]: its batch queues. ARGV: now, the limit, the batch's lines, its
# reservation's id, its lease (s). Returns {1 if reserved, else 0; the lines queued or reserved before it}.
RESERVE_BATCH_LUA = """
local now, limit, lines = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local queued = 0
for i = 2, #KEYS do queued = queued + redis.call('LLEN', KEYS[i]) end
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  queued = queued + tonumber(string.match(member, ':(%d+)$'))
end
if queued + lines > limit then return {0, queued} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), ARGV[4] .. ':' .. ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[5])))
return {1, queued}
"""


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes `x-ratelimit-reset-*`: `120ms`, `1s`, `8.64s`, `6m0s`."""
    ms = max(0, round(seconds * 1000))
    if 0 < ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def bucket_headers(kind: str, per_minute: int | None, level: float) -> dict[str, str]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} of one bucket (none for no limit)."""
    if per_minute is None:
        return {}
    return {f"x-ratelimit-limit-{kind}": str(per_minute),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(level))),
            f"x-ratelimit-reset-{kind}": reset_text((per_minute - level) * BUCKET_WINDOW_S / per_minute)}


class RateLimited(ApiError):
    """A 429 in OpenAI's shape: type `requests` or `tokens`, Retry-After in whole seconds (or, for a request that can
    never pass, `x-should-retry: false`), and the x-ratelimit-* headers of the limits that are set."""

    def __init__(self, kind: str, message: str, retry_after_s: float | None, headers: dict[str, str]) -> None:
        retry = NO_RETRY if retry_after_s is None else {
            "retry-after": str(max(MIN_RETRY_AFTER_S, math.ceil(retry_after_s)))}
        super().__init__(429, message, type=TOKENS if kind == TOKENS else REQUESTS, code=RATE_LIMIT_CODE,
                         headers={**headers, **retry})
        self.kind = kind


@dataclass
class Admission:
    """An admitted request: its slot (None without a concurrency limit), the tokens it reserved (0 without a token
    limit), the headers its answer carries, and the tokens its job reported using once it ended."""

    tenant: str
    slot: str | None
    reserved: int
    headers: dict[str, str]
    used: int | None = None  # None until the job's usage is known: the reservation then stands


def admission_of(state) -> Admission | None:
    """The admission of a request (its `request.state`), if it was admitted under limits."""
    return getattr(state, ADMISSION_FIELD, None)


def note_usage(state, usage: Usage | None) -> None:
    """Record the usage a request's job reported, to settle its reservation by at the request's end."""
    admitted = admission_of(state)
    if admitted is not None and usage is not None:
        admitted.used = usage.total_tokens


class TenantAdmission:
    """Admits requests and batches under their tenant's limits, in Redis; settles requests at their end."""

    def __init__(self, connection: Redis, aconnection: AsyncRedis, limits: TenantLimits, queue: str,
                 refusals: Counter) -> None:
        self.connection, self.aconnection, self.limits, self.queue = connection, aconnection, limits, queue
        self.refusals = refusals  # labelled by tenant and limit
        self._admit = connection.register_script(ADMIT_LUA)
        self._settle = aconnection.register_script(SETTLE_LUA)
        self._reserve_batch = connection.register_script(RESERVE_BATCH_LUA)
        self._held: dict[str, str] = {}  # slot id -> tenant, of this gateway's requests in flight

    # ----- generation requests -----
    def admit(self, tenant: str | None, request: GenerationRequest) -> Admission | None:
        """Count the request against its tenant's limits (sync: run in a thread), or raise RateLimited. None where the
        tenant has no limit on requests."""
        tenant = tenant_of_state(tenant)
        limits = self.limits.of(tenant)
        if not limits.on_requests:
            return None
        rpm, tpm, most = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent_requests
        cost = reserved_tokens(request) if tpm else 0
        if tpm and cost > tpm:
            self.refusals.labels(tenant, TOKENS).inc()
            raise RateLimited(TOKENS, f"Request too large for tokens per minute: it reserves {cost} tokens (its "
                              f"prompt's estimate plus max_tokens), above the limit of {tpm}; ask for fewer tokens.",
                              None, {"x-ratelimit-limit-tokens": str(tpm)})
        slot = uuid.uuid4().hex if most else None
        refused, wait, r, t, held = self._admit(
            keys=[keys.tenant_buckets_key(tenant), keys.tenant_slots_key(tenant)],
            args=[f"{clock():.3f}", rpm or 0, tpm or 0, BUCKET_WINDOW_S, most or 0, cost, slot or "",
                  int(SLOT_LEASE_S * 1000)])
        headers = {**bucket_headers(REQUESTS, rpm, float(r)), **bucket_headers(TOKENS, tpm, float(t))}
        refused = refused.decode() if isinstance(refused, bytes) else refused
        if refused:
            self.refusals.labels(tenant, refused).inc()
            raise RateLimited(refused, _refusal_message(refused, limits, cost, float(wait)), float(wait), headers)
        if slot is not None:
            self._held[slot] = tenant
        return Admission(tenant, slot, cost, headers)

    async def settle(self, admitted: Admission) -> None:
        """Free the request's slot and give back the tokens it reserved but did not use (one round trip)."""
        limits = self.limits.of(admitted.tenant)
        back = 0 if admitted.used is None or not limits.tokens_per_minute else admitted.reserved - admitted.used
        if admitted.slot is None and back == 0:
            return
        if admitted.slot is not None:
            self._held.pop(admitted.slot, None)  # no longer renewed: if the settlement fails, its lease frees it
        try:
            await self._settle(keys=[keys.tenant_buckets_key(admitted.tenant), keys.tenant_slots_key(admitted.tenant)],
                               args=[f"{clock():.3f}", limits.requests_per_minute or 0, limits.tokens_per_minute or 0,
                                     BUCKET_WINDOW_S, admitted.slot or "", back])
        except RedisError:  # the answer is sent already: the slot frees with its lease, the reservation stands
            log.warning("could not settle a request of tenant %s", admitted.tenant, exc_info=True)

    async def keep_leases(self) -> None:
        """Renew this gateway's slot leases, and keep its published limits from expiring, until cancelled."""
        while True:
            await anyio.sleep(SLOT_RENEW_S)
            try:
                await self.renew()
            except RedisError:  # Redis away: the next round renews (a slot lost meanwhile only frees early)
                log.warning("could not renew the leases of the requests in flight", exc_info=True)

    async def renew(self) -> None:
        deadline = clock() + SLOT_LEASE_S
        async with self.aconnection.pipeline(transaction=False) as pipe:
            for slot, tenant in list(self._held.items()):
                pipe.zadd(keys.tenant_slots_key(tenant), {slot: deadline}, xx=True)
                pipe.pexpire(keys.tenant_slots_key(tenant), int(SLOT_LEASE_S * 1000))
            pipe.expire(keys.TENANT_LIMITS, PUBLISHED_LIMITS_TTL_S)
            await pipe.execute()

    # ----- batches -----
    def reserve_batch(self, tenant: str | None, lines: int) -> str | None:
        """Reserve a batch's lines against its tenant's max queued batch lines (sync), or raise RateLimited; the
        reservation's id (None where no limit applies), to release once the batch's lines are in their queues."""
        tenant = tenant_of_state(tenant)
        limit = self.limits.of(tenant).max_queued_batch_lines
        if limit is None:
            return None
        reservation = uuid.uuid4().hex
        queues = batch_queue_keys(self.connection, self.queue, tenant)
        reserved, queued = self._reserve_batch(keys=[keys.tenant_batch_reservations_key(tenant), *queues],
                                               args=[f"{clock():.3f}", limit, lines, reservation, BATCH_LEASE_S])
        if not reserved:
            self.refusals.labels(tenant, BATCH_LINES).inc()
            fits = lines <= limit
            raise RateLimited(BATCH_LINES, f"Too many batch lines queued for max-queued-batch-lines (limit {limit}, "
                              f"{queued} queued): this batch's {lines} lines would pass it"
                              + ("; try again once some have run." if fits else ", even alone."),
                              BATCH_RETRY_AFTER_S if fits else None, {})
        return f"{reservation}:{lines}"

    def release_batch(self, tenant: str | None, reservation: str | None) -> None:
        if reservation is not None:
            self.connection.zrem(keys.tenant_batch_reservations_key(tenant_of_state(tenant)), reservation)


def _refusal_message(kind: str, limits: Limits, cost: int, wait_s: float) -> str:
    retry = f"try again in {max(MIN_RETRY_AFTER_S, math.ceil(wait_s))}s"
    if kind == CONCURRENCY:
        return (f"Too many requests at once for max-concurrent-requests (limit {limits.max_concurrent_requests}): "
                "try again when one of them has ended.")
    if kind == REQUESTS:
        return f"Rate limit reached for requests per minute (limit {limits.requests_per_minute}): {retry}."
    return (f"Rate limit reached for tokens per minute (limit {limits.tokens_per_minute}, this request reserves "
            f"{cost}): {retry}.")


class AdmissionMiddleware:
    """Sends an admitted request's x-ratelimit-* headers with its answer, and settles its admission once the answer's
    last byte is sent or its client has left."""

    def __init__(self, app: ASGIApp, admission: TenantAdmission) -> None:
        self.app, self.admission = app, admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        def admitted() -> Admission | None:
            return scope.get("state", {}).get(ADMISSION_FIELD)

        async def sending(message: Message) -> None:
            found = admitted()
            if message["type"] == "http.response.start" and found is not None and found.headers:
                extra = [(k.encode(), v.encode()) for k, v in found.headers.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            found = admitted()
            if found is not None:
                with anyio.CancelScope(shield=True):
                    await self.admission.settle(found)
