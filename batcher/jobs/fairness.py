"""Fair share between tenants: the Virtual Token Counter (VTC, Sheng et al., OSDI 2024), kept in Redis.

Each tenant has a counter of the tokens it was served in a class of a base queue (`keys.fairness_key`):
prompt tokens count W_PROMPT each and generated tokens W_GENERATED each, as in the paper. The next job of a
class comes from the tenant with the least counter among those with waiting work, so a tenant's small batch is
not stuck behind another's large one, a tenant's burst of chat requests does not hold back another's, and over
any window each backlogged tenant gets its share of the tokens, give or take one request.

Where the tenants' jobs wait:
- batch work has a queue per tenant: the pick compares the counters of the tenants whose queues hold work;
- priority and interactive work of a level share one queue (so a plain-RQ producer, and a worker's blocking
  wait, see one list): the enqueue notes each job's tenant (`keys.job_tenants_key`) and lists the job in its
  tenant's order (`keys.waiting_tenants_key`), and the pick takes the oldest job of the least served tenant,
  however deep in the queue. Jobs that name no tenant (plain RQ) are one more tenant, NO_TENANT, whose oldest
  job the pick looks for among the first FAIR_WINDOW of the queue.

The pick is one Lua script (`PICK_LUA`), so it holds across any number of workers: it takes the jobs a
worker has room for, most urgent class first, and charges each job it takes PICK_CHARGE tokens at once
(workers picking at the same time then see each other's picks). When the job ends, `charge_on` adds its real
cost less that advance, in the transaction that records the job's end. A tenant that comes back from idle is
lifted to the class's virtual time (the counter of the last tenant picked, the least among the backlogged
ones), so idle time banks no credit. A requeued job (its worker died) is charged its advance again: a small
over-charge, never lost work.

A batch line whose batch's window closes within DEADLINE_BOOST_S is *due*: the enqueue notes it in its queue's
due set (`keys.due_key`), and the pick takes due lines before any other batch work, earliest deadline first, and
as urgent work (beyond the free slots, as interactive work is): the engine runs them at interactive urgency.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from rqbatcher.jobs import keys
from rqbatcher.jobs.queues import NO_TENANT, backlog_remove_on, parse_queue, tenant_token
from rqbatcher.jobs.redis_text import as_text
from rqbatcher.service_class import BATCH, DEADLINE_BOOST_S

W_PROMPT = 1.0  # the paper's weights: a generated token costs about twice a prompt token
W_GENERATED = 2.0
PICK_CHARGE = 256.0  # tokens charged when a job is taken; its end corrects it to the real cost
FAIR_WINDOW = 64  # how far into a shared queue the pick looks for a job that names no tenant
VIRTUAL_TIME_FIELD = "~v"  # no tenant token has a "~"

# KEYS, per candidate queue (in urgency order: non-batch groups first, then batch groups): its list, its
# intermediate list, its class's fairness hash, the base's job-tenants hash and the queue's waiting-tenants set
# (read for a shared queue), its due set (read for a batch queue).  ARGV: n, free, extra, batch_first, charge,
# window, due_before (a unix time), fair_extra, then per queue: group, is_batch (1/0), tenant token (a batch
# queue's), fair (1: an interactive queue), then the tokens of the tenants holding a slot of the worker.
# Takes up to free + extra jobs: `extra` only for urgent work (non-batch classes and due batch lines: they
# preempt batch work in the engine), the first `batch_first` from the batch class while it has any (its minimum
# share); then up to `fair_extra` interactive jobs of tenants holding no slot (each preempts a sequence of the
# most-served tenant in the engine). Returns the queues' lengths before, then (queue position, job id, tenant
# charged) triples.
PICK_LUA = """
local n, free, extra, batch_first, charge, window, due_before, fair_extra = tonumber(ARGV[1]),
  tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7],
  tonumber(ARGV[8])
local group, is_batch, tenant, fair, len, holding = {}, {}, {}, {}, {}, {}
local function key(i, k) return KEYS[6 * (i - 1) + k] end
for i = 1, n do
  group[i] = tonumber(ARGV[5 + 4 * i])
  is_batch[i] = ARGV[6 + 4 * i] == '1'
  tenant[i] = ARGV[7 + 4 * i]
  fair[i] = ARGV[8 + 4 * i] == '1'
  len[i] = redis.call('LLEN', key(i, 1))
end
for a = 9 + 4 * n, #ARGV do holding[ARGV[a]] = true end
local result = {}
for i = 1, n do result[i] = len[i] end
-- a tenant's counter, lifted to its class's virtual time (idle time banks no credit)
local function counter(h, t)
  local vt = tonumber(redis.call('HGET', h, '~v') or '0')
  local c = tonumber(redis.call('HGET', h, t) or '0')
  if c < vt then
    redis.call('HSET', h, t, vt)
    c = vt
  end
  return c
end
-- the oldest job of the least served tenant in shared queue i (but the tenants in `skip`): each tenant's waiting
-- jobs are listed in order (<waiting set>:<tenant>); the jobs that name no tenant (plain RQ) are looked for among
-- the first `window`
local function shared_pick(i, skip)
  local h, waiting = key(i, 3), key(i, 6)
  local best_id, best_t, best_c, listed = nil, nil, nil, 0
  for _, t in ipairs(redis.call('SMEMBERS', waiting)) do
    local n = redis.call('LLEN', waiting .. ':' .. t)
    if n == 0 then
      redis.call('SREM', waiting, t)
    else
      listed = listed + n
      local c = counter(h, t)
      if not skip[t] and (best_c == nil or c < best_c) then
        best_id, best_t, best_c = redis.call('LINDEX', waiting .. ':' .. t, 0), t, c
      end
    end
  end
  if listed < len[i] and not skip['""" + NO_TENANT + """'] then
    local ids = redis.call('LRANGE', key(i, 1), 0, window - 1)
    local owners = redis.call('HMGET', key(i, 4), unpack(ids))
    for p = 1, #ids do
      if not owners[p] then
        local c = counter(h, '""" + NO_TENANT + """')
        if best_c == nil or c < best_c then best_id, best_t, best_c = ids[p], '""" + NO_TENANT + """', c end
        break
      end
    end
  end
  return best_id, best_t, best_c
end
-- take shared queue i's next job: (id, tenant, counter), or nil when nothing is left (an entry of a job no longer
-- queued, cancelled or deleted, is dropped on the way)
local function shared_take(i, skip)
  while true do
    local id, t, c = shared_pick(i, skip)
    if id == nil then return nil end
    if t ~= '""" + NO_TENANT + """' then redis.call('LPOP', key(i, 6) .. ':' .. t) end
    redis.call('HDEL', key(i, 4), id)
    if redis.call('LREM', key(i, 1), 1, id) == 1 then return id, t, c end
  end
end
-- take the due batch line with the earliest deadline (a stale entry, its job no longer queued, is dropped)
local function due_take()
  while true do
    local pick, id, at = nil, nil, nil
    for i = 1, n do
      if is_batch[i] and len[i] > 0 then
        local due = redis.call('ZRANGE', key(i, 5), '-inf', due_before, 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
        if due[1] and (at == nil or tonumber(due[2]) < at) then pick, id, at = i, due[1], tonumber(due[2]) end
      end
    end
    if pick == nil then return nil end
    redis.call('ZREM', key(pick, 5), id)
    if redis.call('LREM', key(pick, 1), 1, id) == 1 then return pick, id, tenant[pick], nil end
  end
end
-- take the next line of the least served batch tenant, in the most urgent batch group with work
local function least_served_take()
  local g, best, best_c = nil, nil, nil
  for i = 1, n do
    if is_batch[i] and len[i] > 0 and (g == nil or group[i] == g) then
      g = group[i]
      local c = counter(key(i, 3), tenant[i])
      if best == nil or c < best_c then best, best_c = i, c end
    end
  end
  if best == nil then return nil end
  return best, redis.call('LPOP', key(best, 1)), tenant[best], best_c
end
-- a job taken: into its intermediate list, in the result, and charged to its tenant
local function take(pick, id, t, c)
  redis.call('RPUSH', key(pick, 2), id)  -- each way of taking a job took it out of its queue
  len[pick] = len[pick] - 1
  table.insert(result, pick)
  table.insert(result, id)
  table.insert(result, t)
  if c ~= nil then redis.call('HSET', key(pick, 3), '~v', c) end  -- a due line's pick moves no virtual time
  redis.call('HINCRBYFLOAT', key(pick, 3), t, charge)
end
while free + extra > 0 do
  local pick, id, t, c = nil, nil, nil, nil
  if batch_first > 0 and free > 0 then
    pick, id, t, c = due_take()
    if pick == nil then pick, id, t, c = least_served_take() end
  end
  if pick == nil then
    for i = 1, n do
      if len[i] > 0 then
        if is_batch[i] then
          pick, id, t, c = due_take()
          if pick == nil and free > 0 then pick, id, t, c = least_served_take() end
        else
          id, t, c = shared_take(i, {})
          if id then pick = i end
        end
        break
      end
    end
  end
  if pick == nil then break end
  take(pick, id, t, c)
  if is_batch[pick] then
    redis.call('ZREM', key(pick, 5), id)
    if batch_first > 0 then batch_first = batch_first - 1 end
  end
  if free > 0 then free = free - 1 else extra = extra - 1 end
end
while fair_extra > 0 do
  local pick, id, t, c = nil, nil, nil, nil
  for i = 1, n do
    if fair[i] and len[i] > 0 then
      id, t, c = shared_take(i, holding)
      if id then
        pick = i
        break
      end
    end
  end
  if pick == nil then break end
  take(pick, id, t, c)
  holding[t] = true
  fair_extra = fair_extra - 1
end
return result
"""


@dataclass(frozen=True)
class Candidate:
    """A queue the pick may take from. `group` orders the candidates (lower first); batch queues of one group
    are chosen between by their tenants' counters, the jobs of a shared queue by their tenants' counters."""

    queue_key: str
    intermediate_key: str
    fairness_key: str
    tenants_key: str  # the base's job-tenants hash (keys.job_tenants_key)
    due_key: str  # the queue's due set (keys.due_key)
    waiting_key: str  # the queue's waiting-tenants set (keys.waiting_tenants_key)
    group: int
    batch: bool
    tenant: str  # a batch queue's tenant token
    fair: bool = False  # an interactive queue: its jobs may take the engine's fair room


def cost(prompt_tokens: int, generated_tokens: int) -> float:
    """What serving a request costs its tenant, in weighted tokens."""
    return W_PROMPT * prompt_tokens + W_GENERATED * generated_tokens


class Picker:
    """Runs the pick script for one worker."""

    def __init__(self, connection) -> None:
        self._script = connection.register_script(PICK_LUA)

    def pick(self, candidates: list[Candidate], free: int, extra: int = 0, batch_first: int = 0,
             charge: float = PICK_CHARGE, now: float | None = None, fair_extra: int = 0,
             holding: frozenset[str] = frozenset()) -> tuple[list[int], list[tuple[int, str, str]]]:
        """(each candidate's length before, [(candidate index, job id, tenant charged)] taken in pick order).
        `fair_extra` interactive jobs more are taken from tenants not `holding` a slot."""
        if not candidates or free + extra + fair_extra <= 0:
            return [0] * len(candidates), []
        due_before = (time.time() if now is None else now) + DEADLINE_BOOST_S
        script_keys = []
        args = [len(candidates), free, extra, batch_first, charge, FAIR_WINDOW, due_before, fair_extra]
        for c in candidates:
            script_keys += [c.queue_key, c.intermediate_key, c.fairness_key, c.tenants_key, c.due_key, c.waiting_key]
            args += [c.group, 1 if c.batch else 0, c.tenant, 1 if c.fair else 0]
        args += sorted(holding)
        reply = self._script(keys=script_keys, args=args)
        lengths = [int(n) for n in reply[:len(candidates)]]
        triples = reply[len(candidates):]
        taken = [(int(triples[i]) - 1, as_text(triples[i + 1]), as_text(triples[i + 2]))
                 for i in range(0, len(triples), 3)]
        return lengths, taken


def note_on(pipe, base: str, jobs: list[tuple[str, object, str]], ttl: int) -> None:
    """Queue, on the enqueue's pipeline, what the pick needs to know of the jobs just queued, each as (RQ queue,
    request, job id): the tenant of a job in a shared queue and its place in its tenant's order, the deadline of
    a batch line. The notes live as long as the longest-lived job (`ttl`)."""
    due: dict[str, dict[str, float]] = defaultdict(dict)
    tenants: dict[str, str] = {}
    waiting: dict[str, list[str]] = defaultdict(list)  # a tenant's list in a queue -> the job ids it gains
    for queue, request, job_id in jobs:
        if parse_queue(queue).service_class == BATCH:
            if request.deadline is not None:
                due[keys.due_key(queue)][job_id] = request.deadline.timestamp()
        elif request.tenant is not None:
            tenants[job_id] = tenant = tenant_token(request.tenant)
            if not waiting[keys.waiting_tenants_key(queue, tenant)]:
                pipe.sadd(keys.waiting_tenants_key(queue), tenant)
                _expire_on(pipe, keys.waiting_tenants_key(queue), ttl)
            waiting[keys.waiting_tenants_key(queue, tenant)].append(job_id)
    for key, deadlines in due.items():
        pipe.zadd(key, deadlines)
        _expire_on(pipe, key, ttl)
    for key, ids in waiting.items():
        pipe.rpush(key, *ids)
        _expire_on(pipe, key, ttl)
    if tenants:
        pipe.hset(keys.job_tenants_key(base), mapping=tenants)
        _expire_on(pipe, keys.job_tenants_key(base), ttl)


def forget_on(pipe, queue: str, job_ids: list[str]) -> None:
    """Queue, on the pipeline that takes queued jobs out of `queue` without the pick (a cancel, a batch's sweep),
    the removal of what `note_on` noted of them, and of their backlog entries."""
    if parse_queue(queue).service_class == BATCH:
        pipe.zrem(keys.due_key(queue), *job_ids)
        backlog_remove_on(pipe, queue, job_ids)
    else:
        pipe.hdel(keys.job_tenants_key(keys.base_queue(queue)), *job_ids)


def _expire_on(pipe, key: str, ttl: int) -> None:
    """Let `key` outlive the jobs it notes (and no longer): its TTL is the longest of theirs."""
    pipe.expire(key, ttl, nx=True)
    pipe.expire(key, ttl, gt=True)


def charge_on(pipe, queue: str, tenant: str, prompt_tokens: int, generated_tokens: int) -> None:
    """Queue, on the transaction that records a job's end, the charge of the tenant the pick charged (`tenant`, a
    token): what the job cost, less the pick's advance. `queue` is the job's RQ queue."""
    amount = cost(prompt_tokens, generated_tokens) - PICK_CHARGE
    if amount:
        pipe.hincrbyfloat(keys.fairness_key(keys.base_queue(queue), parse_queue(queue).service_class), tenant, amount)


def served(connection, base: str, service_class: str) -> dict[str, float]:
    """Each tenant's counter in one class of a base queue (what `batcher queues --json` shows)."""
    raw = connection.hgetall(keys.fairness_key(base, service_class))
    return {as_text(k): float(v) for k, v in raw.items() if as_text(k) != VIRTUAL_TIME_FIELD}
