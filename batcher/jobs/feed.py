"""The completion feed: one Redis Stream per queue and one per batch, one entry per finished job.

The worker adds the entries in the transaction that records the job's result
(`rqbatcher.batches.lines.record_outcome_on`, called by `rqbatcher.jobs.ends.record_end`). Subscribers read a
feed with a consumer group: each entry goes to one consumer of the group, is acknowledged once the consumer's
code has handled it, and an entry whose consumer died before acknowledging it is claimed by another consumer after
`claim_idle_s`. Delivery is at least once: a consumer that dies after handling an entry but before acknowledging
it sees the entry handled again elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import ResponseError

from rqbatcher.jobs.redis_text import as_text

DEFAULT_CLAIM_IDLE_S = 60.0  # an entry unacknowledged this long belongs to a dead consumer
DEFAULT_BLOCK_S = 1.0  # one blocking read; dead consumers' entries are looked for between reads
# Entries are taken one at a time: an entry is pending only while its consumer handles it, so
# `claim_idle_s` means "handled for longer than this", and no entry waits behind another in a
# consumer's hands while other consumers idle.
READ_COUNT = 1
GROUP_START = "0"  # a new group reads the feed from its oldest kept entry: nothing since submit is missed


@dataclass(frozen=True)
class Completion:
    """One finished job. `status`: finished, failed, stopped, cancelled or expired."""

    entry_id: str
    job_id: str
    status: str
    custom_id: str | None
    batch_id: str | None
    queue: str
    finish_reason: str | None

    @classmethod
    def from_entry(cls, entry_id, fields: dict) -> Completion:
        f = {as_text(k): as_text(v) for k, v in fields.items()}
        return cls(entry_id=as_text(entry_id), job_id=f["job_id"], status=f["status"],
                   custom_id=f.get("custom_id") or None, batch_id=f.get("batch_id") or None,
                   queue=f.get("queue", ""), finish_reason=f.get("finish_reason") or None)


def follow(connection: Redis, key: str, group: str, consumer: str, *, claim_idle_s: float = DEFAULT_CLAIM_IDLE_S,
           block_s: float = DEFAULT_BLOCK_S, timeout: float | None = None) -> Iterator[Completion]:
    """Yield the feed's entries for `consumer` of `group`, acknowledging each when the caller asks for the
    next one. First this consumer's own unacknowledged entries (it restarted), then entries idle longer
    than `claim_idle_s` in dead consumers' hands, then new ones. With `timeout`, stop once nothing has
    arrived for that long."""
    try:
        connection.xgroup_create(key, group, id=GROUP_START, mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    idle_since = time.monotonic()
    own_pending = True
    while True:
        if own_pending:
            reply = connection.xreadgroup(group, consumer, {key: "0"}, count=READ_COUNT)
            entries = reply[0][1] if reply else []
            own_pending = bool(entries)
        else:
            entries = connection.xautoclaim(key, group, consumer, int(claim_idle_s * 1000), "0-0",
                                            count=READ_COUNT)[1]
            if not entries:
                wait = block_s if timeout is None else min(block_s, max(0.0, timeout - (time.monotonic() - idle_since)))
                reply = connection.xreadgroup(group, consumer, {key: ">"}, count=READ_COUNT,
                                              block=max(1, int(wait * 1000)))
                entries = reply[0][1] if reply else []
        for entry_id, fields in entries:
            if not fields:  # trimmed away while it waited for an acknowledgement: nothing to hand over
                connection.xack(key, group, entry_id)
                continue
            yield Completion.from_entry(entry_id, fields)
            connection.xack(key, group, entry_id)  # the caller's code returned: it asked for the next one
        if entries:
            idle_since = time.monotonic()
        elif timeout is not None and time.monotonic() - idle_since >= timeout:
            return
