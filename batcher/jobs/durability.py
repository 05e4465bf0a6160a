"""Acknowledging only what a replica holds: `confirm` runs Redis's WAIT after a write that is promised to
survive a failover (an enqueue, a job's end), before the writer moves on.

Redis replicates asynchronously: a write the primary acknowledged can be missing from the replica that
Sentinel promotes. WAIT blocks until N replicas acknowledged everything this connection wrote, so a write
confirmed here is on a replica, which Sentinel promotes first (the one with the largest offset) when there is
one. How many replicas to wait for (`ReplicaWait.replicas`): None means 1 where the primary has replicas and 0
where it has none (read from INFO replication, cached REPLICA_COUNT_TTL_S while there are none).

Two traps this module closes:
- WAIT counts the writes of the connection it runs on, and a pooled client may run it on another
  connection than the write's: so it follows a one-key write of its own (MARK_KEY) on the same connection,
  whose offset lies above the write being confirmed. Write, mark and WAIT cost one round trip more than the
  write alone.
- A confirmation that reaches another primary than the write did (a failover in between, or redis-py
  re-sending it after a cut) vouches for nothing: INFO replication's replid, read in the same round trip,
  tells, and the write is then reported unconfirmed, unless the caller finds it on the new primary (`present`).

Unconfirmed, `confirm` raises NotReplicated (`strict`, for a caller who is being answered: an enqueue), or
logs a warning (a worker, whose lease brings the job back if its end is lost).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import ResponseError

from rqbatcher.errors import BatcherError

REPLICAS_ENV = "BATCHER_WAIT_REPLICAS"
TIMEOUT_ENV = "BATCHER_WAIT_TIMEOUT_MS"
AUTO = "auto"
DEFAULT_TIMEOUT_MS = 1000  # the longest a write waits for its replicas before it is reported unconfirmed
REPLICA_COUNT_TTL_S = 5.0  # how long "this primary has no replica" is believed before INFO is read again
MARK_KEY = "batcher:replication-mark"
UNKNOWN_COMMAND = "unknown command"

log = logging.getLogger(__name__)


class NotReplicated(BatcherError, RuntimeError):
    """The write is on the primary, but not confirmed on the replicas asked for: a failover now could lose it.
    It was not undone: an enqueue still runs unless that happens."""


@dataclass(frozen=True)
class ReplicaWait:
    """How writes are confirmed: `replicas` to wait for (None: 1 where the primary has replicas, 0 where it has
    none), at most `timeout_ms` each time."""

    replicas: int | None = None
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas < 0:
            raise ValueError(f"replicas to wait for must be 0 or more, got {self.replicas}")
        if self.timeout_ms < 1:  # WAIT with 0 blocks for ever
            raise ValueError(f"the replica wait timeout must be at least 1 ms, got {self.timeout_ms}")

    @classmethod
    def from_env(cls) -> ReplicaWait:
        """From $BATCHER_WAIT_REPLICAS (a number, or `auto`) and $BATCHER_WAIT_TIMEOUT_MS."""
        replicas = os.environ.get(REPLICAS_ENV, AUTO).strip().lower()
        timeout = os.environ.get(TIMEOUT_ENV, "").strip()
        try:
            return cls(None if replicas in ("", AUTO) else int(replicas),
                       int(timeout) if timeout else DEFAULT_TIMEOUT_MS)
        except ValueError as exc:
            raise ValueError(f"${REPLICAS_ENV} is a number or `auto`, ${TIMEOUT_ENV} a number of ms: {exc}") from None


_configured: ReplicaWait | None = None


def configure(policy: ReplicaWait) -> None:
    """Set this process's policy (the CLI's --wait-replicas and --wait-timeout-ms)."""
    global _configured
    _configured = policy


def current() -> ReplicaWait:
    """This process's policy: as configured, else from the environment."""
    return _configured or ReplicaWait.from_env()


@dataclass
class _Seen:
    """What one thread last saw of the primary behind one client."""

    replid: str | None
    replicas: int  # online replicas
    at: float  # time.monotonic()


_seen: weakref.WeakKeyDictionary[Redis, dict[int, _Seen]] = weakref.WeakKeyDictionary()
_unsupported: weakref.WeakSet[Redis] = weakref.WeakSet()  # fakeredis and the like: no WAIT, no INFO
_lock = threading.Lock()


def confirm(connection: Redis, what: str, policy: ReplicaWait | None = None, *, strict: bool = True,
            present: Callable[[], bool] | None = None) -> int:
    """After `what` was written through `connection`: wait until the policy's replicas hold it. Return how many
    replicas confirmed; unconfirmed, raise NotReplicated (`strict`) or log a warning.

    `present()` tells whether the write is on the primary that answers now: after a failover, a write found
    there is confirmed on that primary's replicas instead of being reported."""
    policy = policy or current()
    if policy.replicas == 0 or connection in _unsupported:
        return 0
    seen = _last_seen(connection)
    if seen is None:
        return 0
    if policy.replicas is None and seen.replicas == 0:
        if time.monotonic() - seen.at < REPLICA_COUNT_TTL_S:
            return 0  # no replica to wait for, as read a moment ago
        seen = _remember(connection, connection.info("replication"))
        if seen.replicas == 0:
            return 0
    try:
        with connection.pipeline(transaction=False) as pipe:
            pipe.set(MARK_KEY, 1)
            pipe.wait(1 if policy.replicas is None else policy.replicas, policy.timeout_ms)
            pipe.info("replication")
            _, acked, info = pipe.execute()
    except ResponseError as exc:  # a managed Redis that lacks WAIT: say so once, and stop asking
        if UNKNOWN_COMMAND not in str(exc).lower():
            raise
        log.warning("this Redis refuses WAIT (%s): writes are acknowledged without a replica's confirmation", exc)
        _unsupported.add(connection)
        return 0
    now = _remember(connection, info)
    needed = policy.replicas if policy.replicas is not None else min(1, now.replicas)
    problem = None
    if now.replid != seen.replid and (seen.replicas or now.replicas):
        if present is not None and present():  # the write reached the new primary (or was replicated to it)
            return confirm(connection, what, policy, strict=strict)
        problem = (f"the primary changed (a failover) since this thread last confirmed a write: {what} may have "
                   "reached the old primary only, and be lost")
    elif acked < needed:
        problem = (f"{acked} of {needed} replicas confirmed {what} within {policy.timeout_ms} ms: it is on the "
                   "primary, and a failover now would lose it")
    if problem is None:
        return acked
    if strict:
        raise NotReplicated(problem)
    log.warning("%s", problem)
    return acked


def _last_seen(connection: Redis) -> _Seen | None:
    """What this thread last saw of the primary, read now if never (None: no replication on this server)."""
    with _lock:
        seen = _seen.get(connection, {}).get(threading.get_ident())
    if seen is not None:
        return seen
    try:
        info = connection.info("replication")
    except ResponseError as exc:  # a server without INFO or WAIT (fakeredis): nothing to confirm with
        if UNKNOWN_COMMAND not in str(exc).lower():
            raise
        _unsupported.add(connection)
        return None
    return _remember(connection, info)


def _remember(connection: Redis, info: dict) -> _Seen:
    replicas = sum(1 for key, value in info.items()
                   if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")
    seen = _Seen(info.get("master_replid"), replicas, time.monotonic())
    with _lock:
        _seen.setdefault(connection, {})[threading.get_ident()] = seen
    return seen
