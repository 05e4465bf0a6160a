"""The Lua scripts behind batcher/batches/: each runs atomically in Redis, and `settle` (in several of them)
ends a batch once every one of its lines is written.

A batch ends once, in `ended`, whichever script ends it: that step also announces the end on the webhook outbox
(exactly one event per batch, in the same atomic step as the transition, so no end is announced twice or lost) and
starts the clock of the output and error files (OpenAI's `output_expires_after` counts from the files' creation,
which is the batch's end).

Scripts run with EVAL (`run`), not EVALSHA: redis-py would send SCRIPT EXISTS before every pipeline, and an
EVALSHA inside MULTI fails with NOSCRIPT after a Redis restart while the rest of the transaction commits.
"""

from __future__ import annotations

# ended(batch, lines, outbox, status, now): the batch has just moved to the terminal `status`. The outbox entry is
# JSON {"type": "batch.<status>", "id", "tenant" (the owner, or null), "created_at" (whole seconds)}. The lines
# (the output and error files) then live `output_expires_s` from now, never past the batch itself.
ENDED = """
local function ended(batch, lines, outbox, status, now)
  local h = redis.call('HMGET', batch, 'id', 'owner', 'output_expires_s')
  local at = math.floor(tonumber(now))
  redis.call('RPUSH', outbox, cjson.encode({type = 'batch.' .. status, id = h[1],
                                            tenant = (h[2] and h[2] ~= '') and h[2] or cjson.null,
                                            created_at = at}))
  local ttl = redis.call('PTTL', batch)
  local expires = at + math.floor(ttl / 1000)
  if h[3] and tonumber(h[3]) < ttl / 1000 then expires = at + tonumber(h[3]) end
  if ttl > 0 then
    redis.call('HSET', batch, 'output_expires_at', expires)
    redis.call('PEXPIREAT', lines, expires * 1000)
  end
end
"""
SETTLE = ENDED + """
local function settle(batch, lines, outbox, now)
  local h = redis.call('HMGET', batch, 'status', 'total', 'completed', 'failed', 'expired_lines')
  local status, total = h[1], tonumber(h[2])
  if not status or not total or tonumber(h[3] or '0') + tonumber(h[4] or '0') < total then
    return status
  end
  local new = nil
  if status == 'in_progress' then
    if tonumber(h[5] or '0') > 0 then  -- workers expired its last jobs before anyone read the batch
      redis.call('HSET', batch, 'status', 'expired', 'expired_at', now, 'swept', '1')
      new = 'expired'
    elseif total == 0 then
      redis.call('HSET', batch, 'status', 'failed', 'failed_at', now)
      new = 'failed'
    else
      redis.call('HSET', batch, 'status', 'completed', 'finalizing_at', now, 'completed_at', now)
      new = 'completed'
    end
  elseif status == 'cancelling' then
    redis.call('HSET', batch, 'status', 'cancelled', 'cancelled_at', now)
    new = 'cancelled'
  end
  if new then
    ended(batch, lines, outbox, new, now)
    return new
  end
  return status
end
"""
# KEYS: batch, lines, batch feed, queue feed, outbox.  ARGV: index, kind, line, expired line ('' if none), now,
# maxlen, then the feed entry: job_id, status, custom_id, batch_id, queue, finish_reason; then the line's usage
# (counted only for a new output line): input tokens, cached input tokens, output tokens.
# Past the output files' expiry nothing is recorded: the lines are gone, so HSETNX could no longer tell a repeat.
RECORD = SETTLE + """
local batch, lines, batch_feed, queue_feed, outbox = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local index, kind, line, expired_line, now, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local status = ARGV[8]
local h = redis.call('HMGET', batch, 'status', 'expires_at', 'output_expires_at')
local live = h[1] and not (h[3] and tonumber(now) >= tonumber(h[3]))
local expired = live and kind == 'failed' and expired_line ~= '' and tonumber(now) >= tonumber(h[2])
if expired then
  line, status = expired_line, 'expired'
end
local entry = {'job_id', ARGV[7], 'status', status, 'custom_id', ARGV[9], 'batch_id', ARGV[10],
               'queue', ARGV[11], 'finish_reason', ARGV[12]}
if live then
  if redis.call('HSETNX', lines, index, line) == 0 then return 0 end
  local ttl = redis.call('PTTL', batch)
  redis.call('HINCRBY', batch, kind, 1)
  if kind == 'completed' then
    redis.call('HINCRBY', batch, 'input_tokens', ARGV[13])
    redis.call('HINCRBY', batch, 'cached_tokens', ARGV[14])
    redis.call('HINCRBY', batch, 'output_tokens', ARGV[15])
  end
  if expired then redis.call('HINCRBY', batch, 'expired_lines', 1) end
  redis.call('XADD', batch_feed, 'MAXLEN', '~', maxlen, '*', unpack(entry))
  if ttl > 0 then
    if h[3] then redis.call('PEXPIREAT', lines, tonumber(h[3]) * 1000) else redis.call('PEXPIRE', lines, ttl) end
    redis.call('PEXPIRE', batch_feed, ttl)
  end
end
redis.call('XADD', queue_feed, 'MAXLEN', '~', maxlen, '*', unpack(entry))
if live then settle(batch, lines, outbox, now) end
return 1
"""
# KEYS: batch, lines, outbox.  ARGV: now.  Validation is over: the batch runs (or has already ended).
START = SETTLE + """
if redis.call('HGET', KEYS[1], 'status') == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[1])
end
return settle(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
"""
# KEYS: batch, lines, outbox.  ARGV: the new status, its timestamp field, now.  Only an active batch moves; a move
# to a terminal status (expired, failed) ends it, a move to `cancelling` does not yet.
END = ENDED + """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
  if ARGV[1] ~= 'cancelling' then ended(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[3]) end
  return 1
end
return 0
"""
# KEYS: batch, lines, outbox.  ARGV: now.  After a sweep wrote every missing line.
SETTLE_ONLY = SETTLE + """
redis.call('HSET', KEYS[1], 'swept', '1')
return settle(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
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
