"""Anthropic's error object, `{"type": "error", "error": {"type", "message"}}`, its type named by the HTTP status as
Anthropic names it, so that the `anthropic` SDK raises the class it would raise against Anthropic's own API; and the
server-sent event framing Anthropic's streams use, in which a failure mid-stream is an `error` event."""

from __future__ import annotations

import json

MESSAGES_PATH = "/v1/messages"  # this path and those below it answer errors in Anthropic's shape
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
INVALID_REQUEST = ERROR_TYPES[400]
SERVER_FAULT = "api_error"  # any other 5xx


def speaks_anthropic(path: str) -> bool:
    """Whether a request to `path` is answered in Anthropic's shapes."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, SERVER_FAULT if status >= 500 else INVALID_REQUEST)


def error_object(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_event(status: int, message: str) -> bytes:
    """A failure inside a stream whose 200 was already sent: Anthropic's `error` event."""
    return sse("error", error_object(status, message))


def sse(name: str, data: dict) -> bytes:
    """One server-sent event as Anthropic writes them: its name, and its data, which repeats the name as `type`."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
