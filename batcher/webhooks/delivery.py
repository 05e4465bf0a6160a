"""The delivery job: one event POSTed to one endpoint, an ordinary RQ job on the `webhooks` queue.

Each attempt signs the body again (a fresh `webhook-timestamp`, the same `webhook-id`), and anything but a 2xx
answer fails it, so that RQ retries it later (`retry_policy`: over more than a day, with a scheduler). A slow
endpoint costs its own job's timeout, never another tenant's deliveries. An endpoint removed meanwhile gets nothing;
a URL that now resolves to a refused address fails the job at once, with no retry.
"""

from __future__ import annotations

import http.client
import logging

from rq import Retry, get_current_job

from rqbatcher.errors import BatcherError
from rqbatcher.webhooks import endpoints
from rqbatcher.webhooks.addresses import RefusedAddress, resolve
from rqbatcher.webhooks.event_payload import encode
from rqbatcher.webhooks.pinned_http import post
from rqbatcher.webhooks.signing import signed_headers

log = logging.getLogger(__name__)

DELIVERY_QUEUE = "webhooks"
HTTP_TIMEOUT_S = 10.0  # connect, and each read: a slow receiver fails the attempt and is tried again later
JOB_TIMEOUT_S = 60  # RQ kills an attempt that outlives this (a receiver that trickles its answer)
# Backoff between attempts: 5 s, 30 s, 2 min, 10 min, 30 min, 1 h, 2 h, 4 h, 8 h, 12 h (about 28 h in all)
RETRY_INTERVALS_S = (5, 30, 120, 600, 1800, 3600, 7200, 14400, 28800, 43200)
DELIVERY_RESULT_TTL_S = 3 * 24 * 3600  # a finished delivery's job is kept: a repeated dispatch then adds none
DELIVERY_FAILURE_TTL_S = 7 * 24 * 3600
SUCCESS_STATUSES = range(200, 300)
QUOTED_ANSWER_BYTES = 200  # of a refusing answer, in the job's failure


class DeliveryFailed(BatcherError):
    """The endpoint did not take the event (no answer, or an answer that is not 2xx): RQ tries again later."""


def retry_policy() -> Retry:
    """Read at each enqueue, so tests can shorten the intervals."""
    return Retry(max=len(RETRY_INTERVALS_S), interval=list(RETRY_INTERVALS_S))


def delivery_job_id(event_id: str, endpoint_id: str) -> str:
    """One job per (event, endpoint), whoever dispatches the event and however often."""
    return f"{event_id}-{endpoint_id}"


def deliver(endpoint_id: str, event: dict) -> dict:
    """POST `event` (its body, OpenAI's event shape) to the endpoint, signed; the answer's status."""
    job = get_current_job()
    endpoint = endpoints.get(job.connection, endpoint_id)
    if endpoint is None:
        return {"skipped": "the endpoint was removed"}
    try:
        target = resolve(endpoint.url, endpoint.allow_private_addresses)
    except RefusedAddress:
        job.retries_left = 0  # a refusal is no passing fault: fail now, not for a day
        raise
    body = encode(event)
    headers = signed_headers(endpoint.secret, event["id"], body)
    try:
        status, answer = post(target, body, headers, HTTP_TIMEOUT_S)
    except (OSError, http.client.HTTPException) as exc:
        raise DeliveryFailed(f"no answer from {endpoint.url} ({target.address}): {exc}") from None
    if status not in SUCCESS_STATUSES:
        raise DeliveryFailed(f"{endpoint.url} answered {status}: {answer[:QUOTED_ANSWER_BYTES]!r}")
    log.info("delivered %s %s to %s (%s)", event["type"], event["id"], endpoint_id, status)
    return {"status": status}
