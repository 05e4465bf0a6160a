"""Token streams: each job's events, buffered by the worker and written in one pipeline per flush.

A flush writes the events of every sequence at once. When steps are short, the worker flushes at
most every STREAM_FLUSH_S (a job's consecutive tokens are then merged into one event), so Redis
costs a fraction of a step; a job's last event is always flushed before its result is recorded.

A stream lives at `batcher:stream:<job_id>`. It is trimmed (MAXLEN ~) and expires with the job's
result: `start` sets its TTL to the result TTL (so the stream of a dead worker goes too), and the
last event sets it again (the failure TTL after an error). A retried job's stream is replaced by
one that starts with `restart`, so it only ever holds the current attempt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from redis import Redis

from batcher import keys
from batcher.schema import MAX_TOKENS_LIMIT, FinishReason, StreamEvent, Usage

# Room for every token of the longest generation plus its other events; trimming only bounds
# what a misbehaving writer could add.
STREAM_MAXLEN = MAX_TOKENS_LIMIT + 16
STREAM_FLUSH_S = 0.02  # a token waits in the buffer this long at most (or one step): no reader notices


@dataclass
class _Pending:
    events: list[StreamEvent] = field(default_factory=list)
    ttl: int | None = None
    set_ttl: bool = False
    replace: bool = False


class StreamWriter:
    """Collects events per job; `flush()` writes them all in one pipeline."""

    def __init__(self, connection: Redis) -> None:
        self.connection = connection
        self._pending: dict[str, _Pending] = {}
        self._flushed_at = 0.0

    def restart(self, job_id: str, execution_id: str, ttl: int | None) -> None:
        """Begin a new attempt's stream, dropping the lost attempt's events (buffered ones included)."""
        self._pending[job_id] = _Pending(replace=True)
        self._add(job_id, StreamEvent(type="restart", execution_id=execution_id), ttl)

    def start(self, job_id: str, execution_id: str, ttl: int | None) -> None:
        self._add(job_id, StreamEvent(type="start", execution_id=execution_id), ttl)

    def token(self, job_id: str, execution_id: str, text: str, token_ids: list[int], index: int) -> None:
        """New tokens; merged into the job's last buffered token event when there is one."""
        events = self._pending.setdefault(job_id, _Pending()).events
        if events and events[-1].type == "token":
            last = events[-1]
            text, token_ids, index = last.text + text, last.token_ids + token_ids, last.index
            events.pop()
        # Built without validation: the worker's own values, on every step's hot path. No TTL change.
        events.append(StreamEvent.model_construct(type="token", execution_id=execution_id, text=text,
                                                  token_ids=token_ids, index=index))

    def done(self, job_id: str, execution_id: str, finish_reason: FinishReason, usage: Usage,
             ttl: int | None) -> None:
        self._add(job_id, StreamEvent(type="done", execution_id=execution_id, finish_reason=finish_reason,
                                      usage=usage), ttl)

    def error(self, job_id: str, execution_id: str, reason: str, ttl: int | None) -> None:
        self._add(job_id, StreamEvent(type="error", execution_id=execution_id, error=reason), ttl)

    def discard(self, job_id: str) -> None:
        """Forget a job's buffered events (its lease is gone: another worker owns its stream now)."""
        self._pending.pop(job_id, None)

    def flush(self, force: bool = False) -> None:
        """Write what is buffered: now if `force`, else once STREAM_FLUSH_S has passed since the last write."""
        if not self._pending or (not force and time.monotonic() - self._flushed_at < STREAM_FLUSH_S):
            return
        pending = self._pending  # kept if the write fails (Redis unreachable): the next flush writes it
        self._flushed_at = time.monotonic()
        # Not a transaction: a lost attempt's write slipping in between the DEL and the restart is
        # harmless, since readers drop everything before a restart anyway.
        with self.connection.pipeline(transaction=False) as pipe:
            for job_id, p in pending.items():
                key = keys.stream_key(job_id)
                if p.replace:
                    pipe.delete(key)
                for event in p.events:
                    pipe.xadd(key, event.to_fields(), maxlen=STREAM_MAXLEN, approximate=True)
                if p.set_ttl:
                    _expire(pipe, key, p.ttl)
            pipe.execute()
        self._pending = {}

    def _add(self, job_id: str, event: StreamEvent, ttl: int | None) -> None:
        pending = self._pending.setdefault(job_id, _Pending())
        pending.events.append(event)
        pending.ttl, pending.set_ttl = ttl, True


def _expire(pipe, key: str, ttl: int | None) -> None:
    """RQ's TTL convention: None or -1 keeps the stream, 0 drops it with the result, N expires it in N s."""
    if ttl is None or ttl < 0:
        pipe.persist(key)
    elif ttl == 0:
        pipe.delete(key)
    else:
        pipe.expire(key, ttl)
