"""The outbox, drained into delivery jobs: `dispatch` makes one RQ job per (event, endpoint of the event's tenant
that wants it) on the `webhooks` queue.

Nothing is lost if a dispatcher dies mid-way: one script moves outbox entries to a claimed set (with the time), and
an entry leaves that set only after its jobs are enqueued; an entry claimed longer than CLAIM_STALE_S ago is taken
again by the next dispatch (a `batcher webhooks worker` runs one every second). Nothing is sent twice either: a
delivery job's id is derived from the event and the endpoint, and an enqueue of an id that exists is refused
atomically (RQ's `unique=True`). With an empty outbox, a dispatch is one round trip (the script), so it can run
after every batch transition and every end of a batch line or background response.
"""

from __future__ import annotations

import logging
import time

from redis import Redis
from rq import Queue
from rq.exceptions import DuplicateJobError
from rq.serializers import JSONSerializer

from rqbatcher.jobs import keys
from rqbatcher.webhooks import endpoints
from rqbatcher.webhooks.delivery import (
    DELIVERY_FAILURE_TTL_S,
    DELIVERY_QUEUE,
    DELIVERY_RESULT_TTL_S,
    JOB_TIMEOUT_S,
    deliver,
    delivery_job_id,
    retry_policy,
)
from rqbatcher.webhooks.event_payload import from_outbox_entry

log = logging.getLogger(__name__)

CLAIM_BATCH = 100  # entries one script call takes
LOGGED_ENTRY_BYTES = 200
CLAIM_STALE_S = 60  # a claim this old is a dead dispatcher's: far longer than enqueuing one entry's jobs takes

# KEYS: outbox, claimed.  ARGV: now, stale-before, how many.  Returns the entries claimed: stale claims first, then
# the oldest outbox entries; each is (re)scored with `now` in the claimed set.
_CLAIM = """
local taken = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local room = tonumber(ARGV[3]) - #taken
if room > 0 then
  local fresh = redis.call('LPOP', KEYS[1], room)
  if fresh then
    for _, entry in ipairs(fresh) do table.insert(taken, entry) end
  end
end
for _, entry in ipairs(taken) do redis.call('ZADD', KEYS[2], ARGV[1], entry) end
return taken
"""


def dispatch(connection: Redis) -> int:
    """Turn every outbox entry (and every stale claimed one) into delivery jobs; the number of jobs enqueued.
    Raises redis errors: a caller that must not fail logs them (the entries wait for the next dispatch)."""
    claim = connection.register_script(_CLAIM)
    queue = Queue(DELIVERY_QUEUE, connection=connection, serializer=JSONSerializer)
    enqueued = 0
    while True:
        now = time.time()
        entries = claim(keys=[keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_CLAIMED],
                        args=[now, now - CLAIM_STALE_S, CLAIM_BATCH])
        for entry in entries:
            enqueued += _enqueue_deliveries(connection, queue, entry)
            connection.zrem(keys.WEBHOOK_OUTBOX_CLAIMED, entry)
        if len(entries) < CLAIM_BATCH:
            return enqueued


def _enqueue_deliveries(connection: Redis, queue: Queue, entry: bytes) -> int:
    try:
        event, tenant = from_outbox_entry(entry)
        wanting = [e for e in endpoints.of_tenant(connection, tenant) if event["type"] in e.events]
    except ValueError as exc:  # not an event, or no tenant's: it can never be delivered
        log.error("dropping a webhook outbox entry that is not an event (%s): %r", exc, entry[:LOGGED_ENTRY_BYTES])
        return 0
    enqueued = 0
    for endpoint in wanting:
        try:
            queue.enqueue(deliver, endpoint.id, event, job_id=delivery_job_id(event["id"], endpoint.id), unique=True,
                          retry=retry_policy(), job_timeout=JOB_TIMEOUT_S, result_ttl=DELIVERY_RESULT_TTL_S,
                          failure_ttl=DELIVERY_FAILURE_TTL_S)
            enqueued += 1
        except DuplicateJobError:  # an earlier dispatch of this event (that died before its end) enqueued it
            pass
    return enqueued


def dispatch_after(connection: Redis, what: str) -> None:
    """`dispatch`, after `what` (an end, a transition) pushed its events: a failure only delays them (a webhooks
    worker dispatches the outbox every second), so it is logged and never fails the caller."""
    try:
        dispatch(connection)
    except Exception:  # noqa: BLE001  (whatever it is, `what` is recorded; its events wait in the outbox)
        log.warning("the webhook outbox was not dispatched after %s; a webhooks worker will", what, exc_info=True)
