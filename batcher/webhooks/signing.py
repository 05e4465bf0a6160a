"""Standard Webhooks signatures (the scheme OpenAI's webhooks use, which `openai`'s `client.webhooks.unwrap`
verifies): HMAC-SHA256, keyed by the endpoint's secret, over `<webhook-id>.<webhook-timestamp>.<body>`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # Standard Webhooks asks for 24 to 64 random bytes
SIGNATURE_VERSION = "v1"


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def signature(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value: `v1,<base64 HMAC-SHA256>`."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def signed_headers(secret: str, webhook_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The three headers of one delivery attempt. The timestamp is the attempt's own (receivers refuse old ones, as
    a replay), the id is the event's (the same on every attempt, so receivers drop repeats)."""
    timestamp = int(time.time() if now is None else now)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(secret, webhook_id, timestamp, body)}
