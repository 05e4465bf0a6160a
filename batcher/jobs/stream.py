"""A job's token stream as Redis holds it: the rule its readers follow, and the writers outside the worker's
own buffered writer.

Workers write a job's events through `rqbatcher.workers.job_worker.stream_writer.StreamWriter` (buffered, fenced by the
job's lease, each event once). When an execution is gone, someone else writes its stream's end: the worker that
recovered the job (cancelled or failed meanwhile), or the client that cancelled it while it was queued.

Every reader follows one rule, `follow`, which does no I/O itself: `Client.stream` drives it with blocking reads
(`read_events`), the gateway with redis.asyncio (`read_events_async`), each with its own timeouts and retries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass

from rqbatcher.jobs import keys
from rqbatcher.sampling_params import MAX_TOKENS_LIMIT
from rqbatcher.schema import StreamEvent

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
    """Which events of a job's stream a reader passes on: those of the execution that wrote the latest `start` or
    `restart`. A rerun's `start` continues the text (it goes on from the tokens the stream holds); a `restart`
    starts it over. Either way, an earlier attempt's late events are not mixed in."""

    def __init__(self) -> None:
        self.current: str | None = None

    def accepts(self, event: StreamEvent) -> bool:
        if event.type in ("start", "restart") or self.current is None:
            self.current = event.execution_id
            return True
        return event.execution_id in (self.current, None)


@dataclass(frozen=True)
class Read:
    """What `follow` asks for next: XREAD `streams` (one key, after the last entry read), waiting for new entries
    where `block`. Send back the reply."""

    streams: dict[str, str]
    block: bool


class InferEnd:
    """What `follow` asks for next: the end of a job that ended without writing one (`Client.inferred_end`, say
    for a job that expired while queued), or None while it has not ended. Send back the answer."""


INFER_END = InferEnd()
Step = Read | InferEnd | StreamEvent


def follow(job_id: str) -> Generator[Step, object, None]:
    """A job's events from the start until `done` or `error`, as a generator that yields what to read next
    (`Read`, `INFER_END`: send back the answer) and the events to pass on (send back None).

    Only events of the execution that wrote the latest `start` or `restart` pass (`AttemptFilter`). A stream that
    goes quiet is checked for an end its job never wrote; that end is passed on once one more read finds nothing
    new."""
    key = keys.stream_key(job_id)
    last_id, attempts = "0-0", AttemptFilter()
    while True:
        reply = yield Read({key: last_id}, block=True)
        if not reply:
            end = yield INFER_END
            if end is not None and not (yield Read({key: last_id}, block=False)):
                yield end
                return
            continue
        for entry_id, fields in reply[0][1]:
            last_id = entry_id
            event = StreamEvent.from_fields(fields)
            if attempts.accepts(event):  # else a lost attempt that is still writing
                yield event
                if event.terminal:
                    return


def read_events(job_id: str, read: Callable[[Read], object], infer_end: Callable[[], StreamEvent | None]
                ) -> Iterator[StreamEvent]:
    """`follow` driven by blocking calls."""
    steps, answer = follow(job_id), None
    while (step := _next(steps, answer)) is not None:
        if isinstance(step, StreamEvent):
            answer = None
            yield step
        else:
            answer = read(step) if isinstance(step, Read) else infer_end()


async def read_events_async(job_id: str, read: Callable[[Read], Awaitable[object]],
                            infer_end: Callable[[], Awaitable[StreamEvent | None]]) -> AsyncIterator[StreamEvent]:
    """`follow` driven by coroutines."""
    steps, answer = follow(job_id), None
    while (step := _next(steps, answer)) is not None:
        if isinstance(step, StreamEvent):
            answer = None
            yield step
        else:
            answer = await (read(step) if isinstance(step, Read) else infer_end())


def _next(steps: Generator[Step, object, None], answer: object) -> Step | None:
    try:
        return steps.send(answer)
    except StopIteration:
        return None
