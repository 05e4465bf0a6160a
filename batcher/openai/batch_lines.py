"""The OpenAI batch file format: one request per line in, one response per line out.

In:  {"custom_id": ..., "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}
Out: {"custom_id": ..., "response": {"status_code": 200, "body": {...}}, "error": null}
This module reads a line's envelope and writes the output line around an answer. The body of a generation line is
read by generation_body.py and answered by generation_answer.py, which the gateway (batcher/gateway) shares for its
HTTP bodies, so a batch line and an HTTP answer never differ in format; batch_endpoints.py adds /v1/responses and
/v1/embeddings lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rqbatcher.errors import quoted
from rqbatcher.openai.generation_body import CHAT_URL, COMPLETIONS_URL, BodyError, parse_body
from rqbatcher.schema import GenerationRequest

GENERATION_ENDPOINTS = (COMPLETIONS_URL, CHAT_URL)


def parse_batch_line(line: str, endpoint: str | None = None,
                     parse: Callable[[Any, str], GenerationRequest] = parse_body,
                     urls: tuple[str, ...] = GENERATION_ENDPOINTS) -> tuple[str | None, GenerationRequest]:
    """Parse one input line into `(custom_id, request)`; raise BatchLineError with a readable reason.

    The line's url is one of `urls`, and `parse(body, url)` makes its request (batch_endpoints.parse_line reads
    every endpoint's lines). `body.model` becomes the request's model (the job runs on a worker serving it). With
    `endpoint`, the line's url must be that one (a batch has one endpoint). The custom_id is returned on the
    exception as `exc.custom_id` when it could be read."""
    custom_id = None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BatchLineError(None, f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise BatchLineError(None, "each line must be a JSON object")
    custom_id = obj.get("custom_id")
    if custom_id is not None and not isinstance(custom_id, str):
        raise BatchLineError(None, "custom_id must be a string")
    url = obj.get("url")
    if obj.get("method", "POST") != "POST":
        raise BatchLineError(custom_id, "method must be POST")
    if url not in urls:
        raise BatchLineError(custom_id, f"url must be one of {', '.join(urls)}, got {quoted(url)}")
    if endpoint is not None and url != endpoint:
        raise BatchLineError(custom_id, f"url must be the batch's endpoint {endpoint}, got {url}")
    try:
        return custom_id, parse(obj.get("body"), url)
    except BodyError as exc:
        raise BatchLineError(custom_id, str(exc)) from None


class BatchLineError(ValueError):
    def __init__(self, custom_id: str | None, message: str) -> None:
        super().__init__(message)
        self.custom_id = custom_id


def success_line(custom_id: str | None, body: dict, request_id: str | None = None) -> dict:
    """An output line around an endpoint's answer `body` (status 200)."""
    line = {"custom_id": custom_id, "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None}
    return {"id": f"batch_req_{request_id}", **line} if request_id is not None else line


def error_line(custom_id: str | None, message: str, code: str = "invalid_request",
               request_id: str | None = None) -> dict:
    line = {"custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
    return {"id": f"batch_req_{request_id}", **line} if request_id is not None else line
