"""API keys: each key is a tenant, which sees only its own files and batches.

Keys come from BATCHER_API_KEYS (comma-separated) and/or a file (one key a line, `#` comments; the key may be
followed by its tenant's limits, `requests-per-minute=60 tokens-per-minute=20000`, see tenant_limits.py). A tenant's
name is derived from its key (`key-` and 16 hex digits of its SHA-256): stable across replicas and
restarts, and the key itself is never written to Redis or a log. A presented key is checked against every
configured key with `hmac.compare_digest` on SHA-256 digests, so the time taken says nothing about how
much of a key matched, nor which key it was.

With no key configured the gateway is open; it then refuses to listen anywhere but on a loopback address
(`check_bind`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from rqbatcher.errors import BatcherError
from rqbatcher.gateway.defaults import API_KEYS_ENV
from rqbatcher.gateway.error_objects import ApiError
from rqbatcher.gateway.tenant_limits import LIMIT_OPTIONS, Limits, parse_limit_options

TENANT_PREFIX = "key-"
TENANT_HASH_CHARS = 16
PROTECTED_PREFIX = "/v1/"  # /health and /metrics stay open for probes and Prometheus
PROTECTED_ROOT_PATHS = ("/tokenize", "/detokenize")  # vLLM's, outside /v1/: jobs, run for a tenant as any


class UnsafeBind(BatcherError):
    """No API key is configured and the gateway was asked to listen beyond loopback."""


def tenant_of(key: str) -> str:
    return TENANT_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:TENANT_HASH_CHARS]


class ApiKeys:
    def __init__(self, keys: Iterable[str] = (), limits: dict[str, Limits] | None = None) -> None:
        """`limits`: a key's own limits, where they differ from the gateway's defaults."""
        self._keys = [(hashlib.sha256(k.encode()).digest(), tenant_of(k)) for k in dict.fromkeys(keys)]
        self.limit_overrides = {tenant_of(k): v for k, v in (limits or {}).items()}  # by tenant

    @classmethod
    def load(cls, env_value: str | None, path: str | Path | None) -> ApiKeys:
        keys = [k.strip() for k in (env_value or "").split(",")]
        limits = {}
        if path is not None:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise BatcherError(f"cannot read the API keys file {path}: {exc.strerror}") from None
            for number, line in enumerate(text.splitlines(), 1):
                words = line.split("#", 1)[0].split()
                if not words:
                    continue
                key, *options = words
                try:
                    if key.partition("=")[0] in LIMIT_OPTIONS:
                        raise ValueError("the line starts with an option: its key comes first")
                    limits[key] = parse_limit_options(options)
                except ValueError as exc:  # the message names the line, never the key on it
                    raise BatcherError(f"the API keys file {path}, line {number}: {exc}") from None
                keys.append(key)
        return cls((k for k in keys if k), limits)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def tenants(self) -> list[str]:
        return [tenant for _, tenant in self._keys]

    def tenant(self, presented: str) -> str | None:
        """The tenant of a presented key, or None. Every configured key is compared, whatever matches."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for known, tenant in self._keys:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found


def check_bind(host: str, keys: ApiKeys) -> None:
    """Refuse an open gateway (no keys) on anything but a loopback address."""
    if keys:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UnsafeBind(f"no API key is configured, so the gateway only listens on 127.0.0.1 (asked: {host}); "
                         f"set {API_KEYS_ENV} or --api-keys-file to listen on {host}")


class AuthMiddleware:
    """Puts the request's tenant in `request.state.tenant` (None on an open gateway), or answers 401."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith(PROTECTED_PREFIX)
                                        or scope["path"] in PROTECTED_ROOT_PATHS):
            tenant = None
            if self.keys:
                presented = _presented_key(scope)
                if presented is None:
                    error = ApiError(401, "You didn't provide an API key: send it as `Authorization: Bearer KEY` "
                                     "(or `x-api-key: KEY`).", code="missing_api_key")
                else:
                    tenant = self.keys.tenant(presented)
                    error = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
                if tenant is None:
                    await error.response(scope["path"])(scope, receive, send)
                    return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def _presented_key(scope: Scope) -> str | None:
    """The key sent as `Authorization: Bearer KEY` (OpenAI's SDKs), or else as `x-api-key: KEY` (Anthropic's)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            break
    return next((v.decode("latin-1").strip() for n, v in scope["headers"] if n == b"x-api-key" and v.strip()), None)
