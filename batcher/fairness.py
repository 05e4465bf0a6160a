"""Fair share between tenants: the Virtual Token Counter (VTC, Sheng et al., OSDI 2024), kept in Redis.

Each tenant has a counter of the tokens it was served in a class of a base queue (`keys.fairness_key`):
prompt tokens count W_PROMPT each and generated tokens W_GENERATED each, as in the paper. The next batch
line comes from the tenant with the least counter among those with waiting work, so a tenant's small batch is
not stuck behind another's large one, and over any window each backlogged tenant gets its share of the
tokens, give or take one request.

The pick is one Lua script (`PICK_LUA`), so it holds across any number of workers: it takes the jobs a
worker has room for, most urgent class first, and charges each batch job it takes PICK_CHARGE tokens at once
(workers picking at the same time then see each other's picks). When the job ends, `charge_on` adds its real
cost less that advance, in the transaction that records the job's end. A tenant that comes back from idle is
lifted to the class's virtual time (the counter of the last tenant picked, the least among the backlogged
ones), so idle time banks no credit. A requeued job (its worker died) is charged its advance again: a small
over-charge, never lost work.
"""

from __future__ import annotations

from dataclasses import dataclass

from batcher import keys
from batcher.service_class import BATCH, parse_queue, tenant_token

W_PROMPT = 1.0  # the paper's weights: a generated token costs about twice a prompt token
W_GENERATED = 2.0
PICK_CHARGE = 256.0  # tokens charged when a batch job is taken; its end corrects it to the real cost
VIRTUAL_TIME_FIELD = "~v"  # no tenant token has a "~"

# KEYS: per candidate queue (in urgency order: non-batch groups first, then batch groups): its list, its
# intermediate list, its class's fairness hash.  ARGV: n, free, extra, batch_first, charge, then per queue:
# group, is_batch (1/0), tenant token.
# Takes up to free + extra jobs: `extra` only for non-batch classes (they preempt batch work in the engine),
# the first `batch_first` from the batch class while it has any (its minimum share). Returns the queues'
# lengths before, then (queue position, job id) pairs.
PICK_LUA = """
local n, free, extra, batch_first, charge = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4]), tonumber(ARGV[5])
local group, is_batch, tenant, len = {}, {}, {}, {}
for i = 1, n do
  group[i] = tonumber(ARGV[3 + 3 * i])
  is_batch[i] = ARGV[4 + 3 * i] == '1'
  tenant[i] = ARGV[5 + 3 * i]
  len[i] = redis.call('LLEN', KEYS[3 * i - 2])
end
local result = {}
for i = 1, n do result[i] = len[i] end
local function least_served()
  local g, best, best_c, vt = nil, nil, nil, nil
  for i = 1, n do
    if is_batch[i] and len[i] > 0 and (g == nil or group[i] == g) then
      g = group[i]
      local h = KEYS[3 * i]
      vt = tonumber(redis.call('HGET', h, '~v') or '0')
      local c = tonumber(redis.call('HGET', h, tenant[i]) or '0')
      if c < vt then
        c = vt
        redis.call('HSET', h, tenant[i], vt)
      end
      if best == nil or c < best_c then best, best_c = i, c end
    end
  end
  return best, best_c
end
while free + extra > 0 do
  local pick, counter = nil, nil
  if batch_first > 0 and free > 0 then pick, counter = least_served() end
  if pick == nil then
    for i = 1, n do
      if len[i] > 0 then
        if is_batch[i] then
          if free > 0 then pick, counter = least_served() end
        else
          pick = i
        end
        break
      end
    end
  end
  if pick == nil then break end
  local id = redis.call('LMOVE', KEYS[3 * pick - 2], KEYS[3 * pick - 1], 'LEFT', 'RIGHT')
  len[pick] = len[pick] - 1
  if id then
    table.insert(result, pick)
    table.insert(result, id)
    if is_batch[pick] then
      redis.call('HSET', KEYS[3 * pick], '~v', counter)
      redis.call('HINCRBYFLOAT', KEYS[3 * pick], tenant[pick], charge)
      batch_first = batch_first - 1
    end
    if free > 0 then free = free - 1 else extra = extra - 1 end
  end
end
return result
"""


@dataclass(frozen=True)
class Candidate:
    """A queue the pick may take from. `group` orders the candidates (lower first); batch queues of one group
    are chosen between by their tenants' counters."""

    queue_key: str
    intermediate_key: str
    fairness_key: str
    group: int
    batch: bool
    tenant: str


def cost(prompt_tokens: int, generated_tokens: int) -> float:
    """What serving a request costs its tenant, in weighted tokens."""
    return W_PROMPT * prompt_tokens + W_GENERATED * generated_tokens


class Picker:
    """Runs the pick script for one worker."""

    def __init__(self, connection) -> None:
        self._script = connection.register_script(PICK_LUA)

    def pick(self, candidates: list[Candidate], free: int, extra: int = 0, batch_first: int = 0,
             charge: float = PICK_CHARGE) -> tuple[list[int], list[tuple[int, str]]]:
        """(each candidate's length before, [(candidate index, job id)] taken in pick order)."""
        if not candidates or free + extra <= 0:
            return [0] * len(candidates), []
        script_keys, args = [], [len(candidates), free, extra, batch_first, charge]
        for c in candidates:
            script_keys += [c.queue_key, c.intermediate_key, c.fairness_key]
            args += [c.group, 1 if c.batch else 0, c.tenant]
        reply = self._script(keys=script_keys, args=args)
        lengths = [int(n) for n in reply[:len(candidates)]]
        pairs = reply[len(candidates):]
        taken = [(int(pairs[i]) - 1, _text(pairs[i + 1])) for i in range(0, len(pairs), 2)]
        return lengths, taken


def charge_on(pipe, queue: str, request, prompt_tokens: int, generated_tokens: int) -> None:
    """Queue, on the transaction that records a job's end, its tenant's charge: what it cost, less the advance
    the pick charged if it came from a batch queue. `queue` is the job's RQ queue."""
    parsed = parse_queue(queue)
    service_class = parsed.service_class
    tenant = parsed.tenant or tenant_token(getattr(request, "tenant", None))
    amount = cost(prompt_tokens, generated_tokens) - (PICK_CHARGE if service_class == BATCH else 0.0)
    if amount:
        pipe.hincrbyfloat(keys.fairness_key(keys.base_queue(queue), service_class), tenant, amount)


def served(connection, base: str, service_class: str) -> dict[str, float]:
    """Each tenant's counter in one class of a base queue (what `batcher queues --json` shows)."""
    raw = connection.hgetall(keys.fairness_key(base, service_class))
    return {_text(k): float(v) for k, v in raw.items() if _text(k) != VIRTUAL_TIME_FIELD}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
