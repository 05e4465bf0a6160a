"""Request bodies, read as a stream under a size limit.

A body past its limit answers 413. The rest of it is read and dropped first (up to DRAIN_LIMIT_BYTES), so
that a client still sending reads the 413 instead of a broken connection; a body declared far larger than
that is refused at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect, Request

from rqbatcher.gateway.error_objects import ApiError, too_large

DRAIN_LIMIT_BYTES = 64 * 2**20
# OpenAI's bodies nest a few levels, a tool's or response format's JSON schema a few dozen: deeper is refused before
# anything (a validator, a serializer) walks it recursively
MAX_JSON_DEPTH = 128


class BodyReader:
    """The chunks of one request's body, counted against `limit`."""

    def __init__(self, request: Request, limit: int, code: str = "request_too_large",
                 what: str = "request body") -> None:
        self.request, self.limit, self.code, self.what = request, limit, code, what
        self.received = 0
        self._done = False

    def too_large(self) -> ApiError:
        return too_large(f"The {self.what} is larger than the limit of {self.limit} bytes.", self.code)

    async def chunks(self) -> AsyncIterator[bytes]:
        declared = self.request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            if int(declared) - self.limit > DRAIN_LIMIT_BYTES:
                raise self.too_large()
            await self.drain()
            raise self.too_large()
        async for chunk in self._receive():
            self.received += len(chunk)
            if self.received > self.limit:
                await self.drain()
                raise self.too_large()
            yield chunk

    async def drain(self) -> None:
        """Read and drop what is left of the body (up to DRAIN_LIMIT_BYTES)."""
        dropped = 0
        async for chunk in self._receive():
            dropped += len(chunk)
            if dropped > DRAIN_LIMIT_BYTES:
                return

    async def _receive(self) -> AsyncIterator[bytes]:
        while not self._done:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            self._done = not message.get("more_body", False)
            if message.get("body"):
                yield message["body"]


async def read_json(request: Request, limit: int) -> dict:
    """The request's JSON object; 413 past `limit`, 400 if it is not a JSON object or nests past MAX_JSON_DEPTH."""
    reader = BodyReader(request, limit)
    body = bytearray()
    async for chunk in reader.chunks():
        body += chunk
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"The body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"The body nests deeper than {MAX_JSON_DEPTH} levels.") from None
    if not isinstance(value, dict):
        raise ApiError(400, "The body must be a JSON object.")
    if nesting_depth(value) > MAX_JSON_DEPTH:
        raise ApiError(400, f"The body nests deeper than {MAX_JSON_DEPTH} levels.")
    return value


def nesting_depth(value) -> int:
    """How deeply `value` nests lists and objects, walked without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in children)
    return deepest
