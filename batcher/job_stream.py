"""A job's token stream as Redis holds it: the rule its readers follow, and the writers outside the worker's
own buffered writer.

Workers write a job's events through `workers.streams.StreamWriter` (buffered, fenced by the job's lease,
each event once). When an execution is gone, someone else writes its stream's end: the worker that
recovered the job (cancelled or failed meanwhile), or the client that cancelled it while it was queued.
Readers (`Client.stream`, the gateway) pass the events through one `AttemptFilter`.
"""

from __future__ import annotations

from batcher import keys
from batcher.schema import MAX_TOKENS_LIMIT, StreamEvent

# Room for every token of the longest generation plus its other events; trimming only bounds
# what a misbehaving writer could add.
STREAM_MAXLEN = MAX_TOKENS_LIMIT + 16


def ttl_arg(ttl: int | None) -> str:
    """RQ's TTL convention as one argument: None or -1 keeps the stream, 0 drops it, N expires it in N s."""
    return "-1" if ttl is None or ttl < 0 else str(ttl)


def append_event(pipe, job_id: str, event: StreamEvent, ttl: int | None) -> None:
    """Queue one event after everything the stream holds, and the stream's TTL."""
    key = keys.stream_key(job_id)
    pipe.xadd(key, event.to_fields(), maxlen=STREAM_MAXLEN, approximate=True)
    ttl = ttl_arg(ttl)
    if ttl == "-1":
        pipe.persist(key)
    elif ttl == "0":
        pipe.delete(key)
    else:
        pipe.expire(key, int(ttl))


class AttemptFilter:
    """Which events of a job's stream a reader passes on: after a `restart`, only the events of the
    restart's execution, so that a lost attempt that is still writing never mixes its text in."""

    def __init__(self) -> None:
        self.current: str | None = None

    def accepts(self, event: StreamEvent) -> bool:
        if event.type == "restart" or self.current is None:
            self.current = event.execution_id
            return True
        return event.execution_id in (self.current, None)
