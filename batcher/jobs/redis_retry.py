"""Waiting out an unreachable Redis (down, restarting, loading its AOF): one backoff for the client and the worker.

redis-py retries each command for a few seconds by itself; past that, callers back off from the first
delay, doubling up to the cap, and try again, rather than crash or spin.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError)
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 5.0

log = logging.getLogger(__name__)
T = TypeVar("T")


class Backoff:
    """Delays that double from FIRST_DELAY_S up to MAX_DELAY_S; `reset()` after a success."""

    def __init__(self) -> None:
        self.delay = 0.0

    def next(self) -> float:
        self.delay = min(MAX_DELAY_S, max(FIRST_DELAY_S, 2 * self.delay))
        return self.delay

    def reset(self) -> None:
        self.delay = 0.0


def retry_while_unreachable(call: Callable[..., T], *args, deadline: float | None = None, what: str = "Redis",
                            **kwargs) -> T:
    """`call(*args, **kwargs)`, retried with backoff while Redis is unreachable, until `deadline`
    (a time.monotonic() value; None waits for ever). Past the deadline the last error is raised."""
    backoff = Backoff()
    while True:
        try:
            return call(*args, **kwargs)
        except REDIS_ERRORS as exc:
            if isinstance(exc, AuthenticationError):  # a wrong password does not heal by waiting
                raise
            delay = backoff.next()
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            log.warning("cannot reach %s (%s); retrying in %.1f s", what, exc, delay)
            time.sleep(delay)


async def retry_while_unreachable_async(call: Callable[..., Awaitable[T]], *args, deadline: float | None = None,
                                        what: str = "Redis", **kwargs) -> T:
    """`await call(*args, **kwargs)`, as `retry_while_unreachable` does it, without blocking the event loop."""
    backoff = Backoff()
    while True:
        try:
            return await call(*args, **kwargs)
        except REDIS_ERRORS as exc:
            if isinstance(exc, AuthenticationError):
                raise
            delay = backoff.next()
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            log.warning("cannot reach %s (%s); retrying in %.1f s", what, exc, delay)
            await asyncio.sleep(delay)
