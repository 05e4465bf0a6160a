"""Following a job from the gateway: its Redis stream read without blocking the event loop, and the text a
client has already been sent when the job's worker is lost and another one starts it again.

`events` reads a stream by the rule every reader follows (`rqbatcher.jobs.stream.follow`), with redis.asyncio.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis as AsyncRedis
from starlette.concurrency import run_in_threadpool

from rqbatcher.client import POLL_S, Client
from rqbatcher.jobs.redis_retry import retry_while_unreachable, retry_while_unreachable_async
from rqbatcher.jobs.stream import Read, read_events_async
from rqbatcher.schema import StreamEvent

OUTAGE_WAIT_S = 30.0  # longer than a Sentinel failover takes (seconds); past it the stream ends with an error


async def events(aconnection: AsyncRedis, client: Client, job_id: str) -> AsyncIterator[StreamEvent]:
    """The job's events from the start until `done` or `error`; a `restart` is passed on (see TextRelay). A Redis
    outage (a failover) is waited out, OUTAGE_WAIT_S at most a read."""

    async def read(step: Read):
        block = {"block": int(POLL_S * 1000)} if step.block else {}
        return await retry_while_unreachable_async(aconnection.xread, step.streams, **block,
                                                   deadline=time.monotonic() + OUTAGE_WAIT_S)

    async def infer_end() -> StreamEvent | None:
        return await run_in_threadpool(retry_while_unreachable, client.inferred_end, job_id,
                                       deadline=time.monotonic() + OUTAGE_WAIT_S)

    async for event in read_events_async(job_id, read, infer_end):
        yield event


class AttemptDiverged(Exception):
    """A restarted job generates other tokens than those the client was already sent."""


class TextRelay:
    """The text deltas to send a client, across restarts of its job.

    Text sent cannot be taken back. After a `restart`, the new attempt's tokens are checked against those
    already sent and held back until they pass them; only then does new text flow again. Greedy and
    seeded requests generate the same tokens again, so the client sees one seamless answer; a new attempt
    that differs raises AttemptDiverged."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self._attempt: tuple[list[int], str] | None = None  # (token ids, text) of a restarted attempt

    def restart(self) -> None:
        self._attempt = ([], "")

    def delta(self, event: StreamEvent) -> str:
        """The text of a token event that the client has not been sent yet ("" while a restart catches up)."""
        if self._attempt is None:
            self.token_ids += event.token_ids
            self.text += event.text
            return event.text
        ids, text = self._attempt
        ids, text = ids + event.token_ids, text + event.text
        shared = min(len(ids), len(self.token_ids))
        if ids[:shared] != self.token_ids[:shared]:
            raise AttemptDiverged("the worker running this request was lost, and the new attempt generates "
                                  "other tokens than those already sent")
        if len(ids) <= len(self.token_ids):
            self._attempt = (ids, text)
            return ""
        if not text.startswith(self.text):
            raise AttemptDiverged("the new attempt's text differs from the text already sent")
        new = text[len(self.text):]
        self.token_ids, self.text, self._attempt = ids, text, None
        return new

    def check_end(self) -> None:
        """At the job's end: a restarted attempt that ended short of the text already sent diverged too."""
        if self._attempt is not None and len(self._attempt[0]) < len(self.token_ids):
            raise AttemptDiverged("the worker running this request was lost, and the new attempt ended before "
                                  "the text already sent")
