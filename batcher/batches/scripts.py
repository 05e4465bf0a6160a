"""The Lua scripts behind batcher/batches/: each runs atomically in Redis, and `settle` (in several of them)
ends a batch once every one of its lines is written.

Scripts run with EVAL (`run`), not EVALSHA: redis-py would send SCRIPT EXISTS before every pipeline, and an
EVALSHA inside MULTI fails with NOSCRIPT after a Redis restart while the rest of the transaction commits.
"""

from __future__ import annotations

SETTLE = """
local function settle(batch, now)
  local h = redis.call('HMGET', batch, 'status', 'total', 'completed', 'failed', 'expired_lines')
  local status, total = h[1], tonumber(h[2])
  if not status or not total or tonumber(h[3] or '0') + tonumber(h[4] or '0') < total then
    return status
  end
  if status == 'in_progress' then
    if tonumber(h[5] or '0') > 0 then  -- workers expired its last jobs before anyone read the batch
      redis.call('HSET', batch, 'status', 'expired', 'expired_at', now, 'swept', '1')
      return 'expired'
    end
    if total == 0 then
      redis.call('HSET', batch, 'status', 'failed', 'failed_at', now)
      return 'failed'
    end
    redis.call('HSET', batch, 'status', 'completed', 'finalizing_at', now, 'completed_at', now)
    return 'completed'
  elseif status == 'cancelling' then
    redis.call('HSET', batch, 'status', 'cancelled', 'cancelled_at', now)
    return 'cancelled'
  end
  return status
end
"""
# KEYS: batch, lines, batch feed, queue feed.  ARGV: index, kind, line, expired line ('' if none), now,
# maxlen, then the feed entry: job_id, status, custom_id, batch_id, queue, finish_reason.
RECORD = SETTLE + """
local batch, lines, batch_feed, queue_feed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local index, kind, line, expired_line, now, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local status = ARGV[8]
local h = redis.call('HMGET', batch, 'status', 'expires_at')
local expired = h[1] and kind == 'failed' and expired_line ~= '' and tonumber(now) >= tonumber(h[2])
if expired then
  line, status = expired_line, 'expired'
end
local entry = {'job_id', ARGV[7], 'status', status, 'custom_id', ARGV[9], 'batch_id', ARGV[10],
               'queue', ARGV[11], 'finish_reason', ARGV[12]}
if h[1] then
  if redis.call('HSETNX', lines, index, line) == 0 then return 0 end
  local ttl = redis.call('PTTL', batch)
  redis.call('HINCRBY', batch, kind, 1)
  if expired then redis.call('HINCRBY', batch, 'expired_lines', 1) end
  redis.call('XADD', batch_feed, 'MAXLEN', '~', maxlen, '*', unpack(entry))
  if ttl > 0 then
    redis.call('PEXPIRE', lines, ttl)
    redis.call('PEXPIRE', batch_feed, ttl)
  end
end
redis.call('XADD', queue_feed, 'MAXLEN', '~', maxlen, '*', unpack(entry))
if h[1] then settle(batch, now) end
return 1
"""
# KEYS: batch.  ARGV: now.  Validation is over: the batch runs (or has already ended).
START = SETTLE + """
if redis.call('HGET', KEYS[1], 'status') == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[1])
end
return settle(KEYS[1], ARGV[1])
"""
# KEYS: batch.  ARGV: the new status, its timestamp field, now.  Only an active batch moves.
END = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
  return 1
end
return 0
"""
# KEYS: batch.  ARGV: now.  After a sweep wrote every missing line.
SETTLE_ONLY = SETTLE + """
redis.call('HSET', KEYS[1], 'swept', '1')
return settle(KEYS[1], ARGV[1])
"""
# KEYS: an RQ queue list.  ARGV: a job id prefix.  Remove that prefix's ids in one pass; return them.
TAKE_PREFIXED = """
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local keep, taken, n = {}, {}, string.len(ARGV[1])
for _, id in ipairs(items) do
  if string.sub(id, 1, n) == ARGV[1] then taken[#taken + 1] = id else keep[#keep + 1] = id end
end
if #taken > 0 then
  redis.call('DEL', KEYS[1])
  for i = 1, #keep, 1000 do
    redis.call('RPUSH', KEYS[1], unpack(keep, i, math.min(i + 999, #keep)))
  end
end
return taken
"""


def run(client, source: str, keys_: list[str], args: list):
    """Run a script with EVAL: on a pipeline it joins the transaction with no extra round trip (EVALSHA
    through redis-py's Script would first ask SCRIPT EXISTS), and it never meets NOSCRIPT after a Redis
    restart. Redis caches the compiled script; each call sends its text."""
    return client.eval(source, len(keys_), *keys_, *args)
