"""Each tenant's webhook endpoints, in Redis: the URL, the events it wants, its signing secret, and whether an
operator let it reach private addresses.

A tenant is the gateway's (`key-<16 hex>`, derived from an API key) or a batch's owner; None is work that names
no tenant (an open gateway's), whose endpoints get only that work's events. The secret is stored, since every
delivery is signed with it, but is shown once, when the endpoint is added.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass

from redis import Redis

from rqbatcher.jobs import keys
from rqbatcher.webhooks.addresses import resolve
from rqbatcher.webhooks.event_payload import EVENT_TYPES
from rqbatcher.webhooks.signing import new_secret

ENDPOINT_ID_HEX_CHARS = 24
MAX_URL_CHARS = 2048


@dataclass(frozen=True)
class Endpoint:
    id: str
    tenant: str | None
    url: str
    events: tuple[str, ...]
    secret: str
    allow_private_addresses: bool
    created_at: int

    def public(self) -> dict:
        """The endpoint without its secret: what a listing shows."""
        return {k: v for k, v in asdict(self).items() if k != "secret"} | {"events": list(self.events)}


def add(connection: Redis, url: str, *, tenant: str | None = None, events: tuple[str, ...] = EVENT_TYPES,
        allow_private_addresses: bool = False) -> Endpoint:
    """Add an endpoint, with a new secret. RefusedAddress for a URL that may not be reached (a private address
    without `allow_private_addresses`); UnresolvedHost for a host with no address."""
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"a webhook URL has at most {MAX_URL_CHARS} characters")
    keys.webhook_tenant_key(tenant)  # a valid tenant name, before any lookup
    resolve(url, allow_private_addresses)
    unknown = sorted(set(events) - set(EVENT_TYPES))
    if unknown or not events:
        raise ValueError(f"events are some of {', '.join(EVENT_TYPES)}; got {', '.join(unknown) or 'none'}")
    endpoint = Endpoint(id=keys.WEBHOOK_ENDPOINT_ID_PREFIX + secrets.token_hex(ENDPOINT_ID_HEX_CHARS // 2),
                        tenant=tenant, url=url, events=tuple(dict.fromkeys(events)), secret=new_secret(),
                        allow_private_addresses=allow_private_addresses, created_at=int(time.time()))
    with connection.pipeline() as pipe:
        pipe.set(keys.webhook_endpoint_key(endpoint.id), json.dumps(asdict(endpoint)))
        pipe.sadd(keys.webhook_tenant_key(tenant), endpoint.id)
        pipe.sadd(keys.WEBHOOK_ENDPOINTS, endpoint.id)
        pipe.execute()
    return endpoint


def get(connection: Redis, endpoint_id: str) -> Endpoint | None:
    raw = connection.get(keys.webhook_endpoint_key(endpoint_id))
    return None if raw is None else _decoded(raw)


def of_tenant(connection: Redis, tenant: str | None) -> list[Endpoint]:
    """The endpoints of one tenant (None: of work that names no tenant)."""
    return _load(connection, connection.smembers(keys.webhook_tenant_key(tenant)))


def every(connection: Redis) -> list[Endpoint]:
    return _load(connection, connection.smembers(keys.WEBHOOK_ENDPOINTS))


def remove(connection: Redis, endpoint_id: str) -> bool:
    """Remove an endpoint; False if there was none. Its deliveries still queued find it gone and send nothing."""
    endpoint = get(connection, endpoint_id)
    if endpoint is None:
        return False
    with connection.pipeline() as pipe:
        pipe.delete(keys.webhook_endpoint_key(endpoint_id))
        pipe.srem(keys.webhook_tenant_key(endpoint.tenant), endpoint_id)
        pipe.srem(keys.WEBHOOK_ENDPOINTS, endpoint_id)
        pipe.execute()
    return True


def _load(connection: Redis, ids) -> list[Endpoint]:
    ids = sorted(i.decode() if isinstance(i, bytes) else i for i in ids)
    if not ids:
        return []
    found = connection.mget([keys.webhook_endpoint_key(i) for i in ids])
    return sorted((_decoded(raw) for raw in found if raw is not None), key=lambda e: (e.created_at, e.id))


def _decoded(raw: bytes | str) -> Endpoint:
    fields = json.loads(raw)
    return Endpoint(**{**fields, "events": tuple(fields["events"])})
