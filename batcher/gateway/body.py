"""Request bodies, read as a stream under a size limit.

A body past its limit answers 413. The rest of it is read and dropped first (up to DRAIN_LIMIT_BYTES), so
that a client still sending reads the 413 instead of a broken connection; a body declared far larger than
that is refused at once. A JSON body that Python's parser reads but that is not JSON as RFC 8259 has it (NaN,
Infinity), or whose text is not Unicode (a lone surrogate escape, `\\ud800`), answers 400 as any malformed body does:
no answer or Redis key could hold it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from rqbatcher.gateway.error_objects import ApiError, too_large
from rqbatcher.gateway.numbers import number_of

T = TypeVar("T")

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
        declared = number_of(self.request.headers.get("content-length"))
        if declared is not None and declared > self.limit:
            if declared - self.limit > DRAIN_LIMIT_BYTES:
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


async def read_parsed(request: Request, parse: Callable[[dict], T], refusal: type[Exception]) -> T:
    """The request's JSON body read by `parse` into what its route runs; a `refusal` `parse` raises (a message and
    the `param` at fault) is a 400."""
    body = await read_json(request, request.app.state.config.max_request_bytes)
    try:
        return parse(body)
    except refusal as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


async def read_json(request: Request, limit: int) -> dict:
    """The request's JSON object; 413 past `limit`, 400 if it is not a JSON object, nests past MAX_JSON_DEPTH, or
    holds what JSON has not (NaN, Infinity, a lone surrogate)."""
    reader = BodyReader(request, limit)
    body = bytearray()
    async for chunk in reader.chunks():
        body += chunk
    try:
        value = json.loads(body, parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"The body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"The body nests deeper than {MAX_JSON_DEPTH} levels.") from None
    if not isinstance(value, dict):
        raise ApiError(400, "The body must be a JSON object.")
    depth, unicode = _shape(value)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"The body nests deeper than {MAX_JSON_DEPTH} levels.")
    if not unicode:
        raise ApiError(400, "The body is not valid JSON: it holds a lone surrogate (\\ud800 to \\udfff), which is no "
                            "character.")
    return value


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON number")


def nesting_depth(value) -> int:
    """How deeply `value` nests lists and objects, walked without recursion."""
    return _shape(value)[0]


def _shape(value) -> tuple[int, bool]:
    """(how deeply `value` nests lists and objects, whether each of its strings, keys too, is Unicode text that UTF-8
    can encode: a lone surrogate is not), in one walk without recursion that stacks containers only."""
    deepest, unicode, pending = 0, True, [([value], 0)]
    while pending:
        container, depth = pending.pop()
        deepest = max(deepest, depth)
        for child in [*container, *container.values()] if isinstance(container, dict) else container:
            if isinstance(child, (dict, list)):
                pending.append((child, depth + 1))
            elif isinstance(child, str) and not child.isascii():
                unicode = unicode and _encodes(child)
    return deepest, unicode


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
