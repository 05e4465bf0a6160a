"""The events a webhook announces: their types, their ids, and the body a receiver gets (OpenAI's event shape,
which `openai.types.webhooks.UnwrapWebhookEvent` parses)."""

from __future__ import annotations

import hashlib
import json

BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")
RESPONSE_EVENTS = ("response.completed", "response.failed", "response.cancelled", "response.incomplete")
EVENT_TYPES = BATCH_EVENTS + RESPONSE_EVENTS
EVENT_ID_PREFIX = "evt_"
EVENT_ID_HEX_CHARS = 32


def event_id(event_type: str, subject_id: str) -> str:
    """The same id for every announcement of one end (a repeated dispatch, each retry): the receiver's key to drop
    repeats, and the `webhook-id` header."""
    digest = hashlib.sha256(f"{event_type}:{subject_id}".encode()).hexdigest()
    return EVENT_ID_PREFIX + digest[:EVENT_ID_HEX_CHARS]


def from_outbox_entry(raw: bytes | str) -> tuple[dict, str | None]:
    """The event body an outbox entry announces, and the tenant whose endpoints get it; ValueError if it is not one."""
    entry = json.loads(raw)
    if not isinstance(entry, dict):
        raise ValueError("an outbox entry is a JSON object")
    event_type, subject, tenant, created_at = (entry.get(k) for k in ("type", "id", "tenant", "created_at"))
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}")
    if not isinstance(subject, str) or not subject:
        raise ValueError("an outbox entry names the batch or response that ended")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError("an outbox entry's tenant is a string or null")
    if not isinstance(created_at, (int, float)) or isinstance(created_at, bool):
        raise ValueError("an outbox entry's created_at is a unix time")
    body = {"id": event_id(event_type, subject), "object": "event", "created_at": int(created_at),
            "type": event_type, "data": {"id": subject}}
    return body, tenant


def encode(body: dict) -> bytes:
    """The exact bytes sent and signed."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
