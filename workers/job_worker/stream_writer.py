"""Token streams: each job's events, buffered by the worker and written once each, fenced by the job's lease.

A flush writes the events of every job at once, in one Lua script call. When steps are short, the worker
flushes at most every STREAM_FLUSH_S (a job's consecutive tokens are then merged into one event), so Redis
costs a fraction of a step. A job's last events are written in the transaction that records its result.

Three guarantees, enforced by Redis itself:
- Fenced: the script writes a job's events only while the job's lease key (`keys.lease_key`) holds the
  writing execution's id. An execution that lost its lease (its worker was cut off for longer than a
  lease, and another worker restarted the job) writes nothing more, even if its write arrives late.
- No gap: a write checks that the stream still holds the last event this execution wrote. A failover can lose
  acknowledged events (replication is asynchronous); the execution's stream then starts over with `restart` and
  its whole text so far (`_restart_after_gap`), which a reader takes as it takes any restart.
- Exactly once: every event has an explicit stream id, `<base_ms>-<seq>`, fixed when it is buffered.
  A write whose reply was lost (a connection cut mid-flush) is sent again as it was, and Redis refuses the
  ids it already holds. An event that was part of such a write is sealed: later tokens go into a new event.
`base_ms` lies above every id an earlier attempt wrote, so a reader's position stays valid across attempts.

A stream lives at `batcher:stream:<job_id>`, trimmed (MAXLEN ~), and expires with the job's result: `start`
sets its TTL to the result TTL (so the stream of a dead worker goes too), the last event sets it again.
A rerun job's stream continues: the new execution writes `start` and goes on from the tokens the stream holds
(`workers.job_worker.resume`). Only where that is impossible (the stream lost its beginning or has a gap) is it
replaced by one that starts with `restart`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from redis import Redis

from rqbatcher.jobs import keys
from rqbatcher.jobs.ends import EndStatus, terminal_event
from rqbatcher.jobs.redis_text import as_text
from rqbatcher.jobs.stream import STREAM_MAXLEN, ttl_arg
from rqbatcher.schema import STREAM_FIELD, ChatFormat, GenerationResult, StreamEvent, TokenLogprob, Usage
from rqbatcher.workers.job_worker.resume import Resumed

log = logging.getLogger(__name__)

STREAM_FLUSH_S = 0.02  # a token waits in the buffer this long at most (or one step): no reader notices
KEEP_TTL = ""  # a write that leaves the stream's TTL as it is

# KEYS: per job, its lease key and its stream key. ARGV: maxlen, the field name, then per job: the execution
# id, the id below which older events are dropped first ('' for none), the id of the last event this execution
# wrote ('' for none yet), the TTL (`ttl_arg`, or '' to keep it), the number of events, and each event's id and
# payload. Returns the 1-based positions of the jobs whose lease is not held, and, negated, those whose stream
# lacks an event this execution wrote (a failover lost it): writing on would leave a gap, so nothing is written.
WRITE_EVENTS_LUA = """
local function older(a, b)
  local ams, aseq = string.match(a, '(%d+)-(%d+)')
  local bms, bseq = string.match(b, '(%d+)-(%d+)')
  if tonumber(ams) ~= tonumber(bms) then return tonumber(ams) < tonumber(bms) end
  return tonumber(aseq) < tonumber(bseq)
end
local lost = {}
local a = 3
for j = 1, #KEYS, 2 do
  local lease, stream = KEYS[j], KEYS[j + 1]
  local execution, below, after, ttl, n = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], tonumber(ARGV[a + 4])
  a = a + 5
  local intact = true
  if after ~= '' then
    local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
    intact = top[1] ~= nil and not older(top[1][1], after)
  end
  if redis.call('GET', lease) ~= execution then
    table.insert(lost, (j + 1) / 2)
  elseif not intact then
    table.insert(lost, -(j + 1) / 2)
  else
    if below ~= '' then
      local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
      if top[1] and older(top[1][1], below) then redis.call('DEL', stream) end
    end
    for i = 0, n - 1 do
      redis.pcall('XADD', stream, 'MAXLEN', '~', ARGV[1], ARGV[a + 2 * i], ARGV[2], ARGV[a + 2 * i + 1])
    end
    if ttl == '-1' then redis.call('PERSIST', stream)
    elseif ttl == '0' then redis.call('DEL', stream)
    elseif ttl ~= '' then redis.call('EXPIRE', stream, ttl) end
  end
  a = a + 2 * n
end
return lost
"""


def stream_id_ms(stream_id: bytes | str | None) -> int | None:
    if stream_id is None:
        return None
    text = as_text(stream_id)
    return int(text.split("-", 1)[0])


@dataclass
class _Attempt:
    """One execution's stream: its unwritten events, with their ids, and the TTL to set with them."""

    job_id: str
    execution_id: str
    base_ms: int
    replace: bool  # an earlier attempt's events are in the stream: the first write drops them
    next_seq: int = 0
    events: list[tuple[str, StreamEvent]] = field(default_factory=list)
    sealed: int = 0  # events[:sealed] were in a write whose outcome is unknown: nothing is merged into them
    written_to: str = ""  # the id of the last event known written: the stream must still hold it
    ttl: str = KEEP_TTL
    start_ttl: str = KEEP_TTL  # the TTL the stream started with, for a stream that a failover lost whole
    # Everything generated so far, by choice, for a start over after a gap (text as its deltas: joined only then).
    text: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    prompt_usage: Usage | None = None  # carried by each choice's first token event (StreamEvent.usage)
    chat_format: ChatFormat | None = None  # a chat job's, carried by `start`: how a reader reads its calls

    def add(self, event: StreamEvent) -> None:
        self.events.append((f"{self.base_ms}-{self.next_seq}", event))
        self.next_seq += 1

    def script_args(self) -> list:
        below = f"{self.base_ms}-0" if self.replace else ""
        args = [self.execution_id, below, self.written_to, self.ttl, len(self.events)]
        for event_id, event in self.events:
            args += [event_id, event.to_fields()[STREAM_FIELD]]
        return args


class StreamWriter:
    """Collects events per execution (a job restarted on the same worker has two, for a moment); `flush()` writes
    them all in one fenced script call."""

    def __init__(self, connection: Redis) -> None:
        self.connection = connection
        self._write = connection.register_script(WRITE_EVENTS_LUA)
        self._attempts: dict[str, _Attempt] = {}
        self._flushed_at = 0.0
        self._in_transaction: dict[str, int] = {}  # execution id -> its write's position in the end transaction

    def begin(self, job_id: str, execution_id: str, top_id: bytes | str | None, ttl: int | None,
              resumed: Resumed | None = None, chat_format: ChatFormat | None = None) -> None:
        """Start an execution's stream. `top_id` is the stream's last id if it exists: an earlier attempt wrote it.
        With `resumed` (what that stream holds, which this execution goes on from), the stream continues: `start`,
        then this execution's tokens, and the first write checks that the stream still holds `top_id`. Without,
        this execution replaces the stream and begins with `restart`. A chat job's `start` carries `chat_format`."""
        top_ms = stream_id_ms(top_id)
        base_ms = max(int(time.time() * 1000), (top_ms or 0) + 1)
        replace = top_ms is not None and resumed is None
        attempt = self._attempts[execution_id] = _Attempt(job_id, execution_id, base_ms, replace=replace,
                                                          chat_format=chat_format)
        if replace:
            attempt.add(StreamEvent(type="restart", execution_id=execution_id))
        if resumed is not None:
            attempt.written_to = as_text(top_id)
            attempt.text = {choice: [text] for choice, text in resumed.text.items()}
            attempt.token_ids = {choice: list(p.token_ids) for choice, p in resumed.progress.items()}
            attempt.prompt_usage = resumed.prompt_usage
        attempt.add(StreamEvent(type="start", execution_id=execution_id, chat_format=chat_format))
        attempt.ttl = attempt.start_ttl = ttl_arg(ttl)

    def token(self, execution_id: str, text: str, token_ids: list[int], index: int,
              logprobs: list[TokenLogprob] | None = None, choice: int = 0, prompt_usage: Usage | None = None) -> None:
        """New tokens of one choice (and their logprobs, when asked); merged into the execution's last buffered
        token event when that one was never sent and is of the same choice. A choice's first tokens (`index` 0)
        come with the prompt's usage, which their event carries."""
        attempt = self._attempts[execution_id]
        usage = None
        if index == 0 and prompt_usage is not None:
            usage = attempt.prompt_usage = prompt_usage
        attempt.text.setdefault(choice, []).append(text)
        attempt.token_ids.setdefault(choice, []).extend(token_ids)
        if (len(attempt.events) > attempt.sealed and attempt.events[-1][1].type == "token"
                and attempt.events[-1][1].choice == choice):
            event_id, last = attempt.events.pop()
            text, token_ids, index = last.text + text, last.token_ids + token_ids, last.index
            if last.logprobs is not None:
                logprobs = last.logprobs + (logprobs or [])
            attempt.events.append((event_id, StreamEvent(
                type="token", execution_id=attempt.execution_id, text=text, token_ids=token_ids, index=index,
                logprobs=logprobs, choice=choice, usage=last.usage)))
            return
        # Validated construction: with pydantic 2 it is about 3x faster than model_construct here. No TTL change.
        attempt.add(StreamEvent(type="token", execution_id=attempt.execution_id, text=text,
                                token_ids=token_ids, index=index, logprobs=logprobs, choice=choice, usage=usage))

    def end(self, execution_id: str, status: EndStatus, result: GenerationResult | None, reason: str | None,
            ttl: int | None) -> None:
        """The execution's terminal event (`rqbatcher.jobs.ends.terminal_event`), and the stream's TTL from then on."""
        attempt = self._attempts[execution_id]
        attempt.add(terminal_event(status, result, reason, execution_id=attempt.execution_id))
        attempt.ttl = ttl_arg(ttl)

    def discard(self, execution_id: str) -> None:
        """Forget an execution's stream (it ended, or its lease is gone: another one owns the job's stream now)."""
        self._attempts.pop(execution_id, None)
        self._in_transaction.pop(execution_id, None)

    def flush(self, force: bool = False, exclude: set[str] = frozenset()) -> list[str]:
        """Write what is buffered, but for the executions in `exclude`: now if `force`, else once STREAM_FLUSH_S
        has passed since the last write. Return the executions whose lease this worker no longer holds (nothing
        of theirs was written). If the call fails, the events stay buffered, sealed, for the next flush."""
        pending = [e for e, a in self._attempts.items() if a.events and e not in exclude]
        if not pending or (not force and time.monotonic() - self._flushed_at < STREAM_FLUSH_S):
            return []
        self._flushed_at = time.monotonic()
        lost = self._call(self.connection, pending)
        gaps = {pending[-i - 1] for i in lost if i < 0}
        for execution_id in pending:
            if execution_id in gaps:
                self._restart_after_gap(execution_id)  # written by the next flush
            else:
                self._written(execution_id)
        return [pending[i - 1] for i in lost if i > 0]

    def write_with(self, pipe, execution_id: str) -> None:
        """Queue an execution's buffered events on `pipe` (the transaction that records its end), fenced the same way;
        `after_transaction` then checks what the write found."""
        if self._attempts[execution_id].events:
            self._in_transaction[execution_id] = len(pipe)
            self._call(pipe, [execution_id])

    def after_transaction(self, replies: list, execution_ids: list[str]) -> None:
        """After the transaction that recorded these executions' ends (so their leases were held): a stream that
        lacked events a failover lost refused the last ones; it is written again, from a `restart` with the
        whole text, unfenced, since the lease is released and nothing else writes the stream of an ended job."""
        for execution_id in execution_ids:
            at = self._in_transaction.pop(execution_id, None)
            if at is None or not replies[at]:
                continue
            self._restart_after_gap(execution_id)
            attempt = self._attempts[execution_id]
            key = keys.stream_key(attempt.job_id)
            with self.connection.pipeline() as pipe:
                pipe.delete(key)
                for event_id, event in attempt.events:
                    pipe.xadd(key, event.to_fields(), id=event_id, maxlen=STREAM_MAXLEN, approximate=True)
                if attempt.ttl == "0":
                    pipe.delete(key)
                elif attempt.ttl not in (KEEP_TTL, "-1"):
                    pipe.expire(key, int(attempt.ttl))
                pipe.execute()
            self._written(execution_id)

    def _restart_after_gap(self, execution_id: str) -> None:
        """The stream lacks events this execution wrote: start it over, above every id this execution used, with
        `restart`, `start`, its whole text so far in one token event, and its unwritten end if any."""
        attempt = self._attempts[execution_id]
        log.warning("job %s: its stream lost events it held (a failover); starting it over with a restart",
                    attempt.job_id)
        last_id = attempt.events[-1][0] if attempt.events else attempt.written_to
        ends = [event for _, event in attempt.events if event.terminal]
        attempt.base_ms = max(int(time.time() * 1000), stream_id_ms(last_id) + 1)
        attempt.next_seq, attempt.events, attempt.sealed, attempt.written_to = 0, [], 0, ""
        attempt.replace = True  # the first write drops what the stream holds
        attempt.ttl = attempt.ttl if attempt.ttl != KEEP_TTL else attempt.start_ttl
        attempt.add(StreamEvent(type="restart", execution_id=execution_id))
        attempt.add(StreamEvent(type="start", execution_id=execution_id, chat_format=attempt.chat_format))
        for choice, token_ids in sorted(attempt.token_ids.items()):
            attempt.add(StreamEvent(type="token", execution_id=execution_id, text="".join(attempt.text[choice]),
                                    token_ids=list(token_ids), index=0, choice=choice, usage=attempt.prompt_usage))
        for event in ends:
            attempt.add(event)

    def _call(self, client, execution_ids: list[str]) -> list[int]:
        keys_, args = [], [STREAM_MAXLEN, STREAM_FIELD]
        for execution_id in execution_ids:
            attempt = self._attempts[execution_id]
            attempt.sealed = len(attempt.events)  # from here on, the outcome of these events is unknown
            keys_ += [keys.lease_key(attempt.job_id), keys.stream_key(attempt.job_id)]
            args += attempt.script_args()
        return self._write(keys=keys_, args=args, client=client)

    def _written(self, execution_id: str) -> None:
        attempt = self._attempts[execution_id]
        attempt.written_to = attempt.events[-1][0] if attempt.events else attempt.written_to
        attempt.events, attempt.sealed, attempt.replace, attempt.ttl = [], 0, False, KEEP_TTL
