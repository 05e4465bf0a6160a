"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, and the status each fault answers.

400 a malformed request, 401 no valid key, 404 an unknown id or model, 413 too large, 429 the queue is full or a
tenant's limit is reached (tenant_admission.RateLimited), 503 Redis unreachable. A fault of ours (a bug) is a 500
with no detail; the traceback goes to the log.
A message is at most MAX_MESSAGE_CHARS long, and quotes at most a short prefix of what the client sent
(rqbatcher.errors.quoted); what the URL holds (an id, a model's name, a query's values) is cut so in any message.
On Anthropic's paths (/v1/messages) the same faults answer Anthropic's error object (rqbatcher.anthropic_messages).
"""

from __future__ import annotations

import logging

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from rqbatcher.anthropic_messages.anthropic_errors import error_object as anthropic_error_object
from rqbatcher.anthropic_messages.anthropic_errors import speaks_anthropic
from rqbatcher.batches.batch_object import BatchInputError, BatchNotFound
from rqbatcher.batches.file_store import FileNotFound, FileTooLarge
from rqbatcher.client import QueueFull
from rqbatcher.errors import short_name, shortened
from rqbatcher.jobs.durability import NotReplicated

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
# Tells the official SDKs not to retry a failure that would fail again (they retry every 5xx otherwise).
NO_RETRY = {"x-should-retry": "false"}
MAX_MESSAGE_CHARS = 2000
CUT_MARK = "..."


class ApiError(Exception):
    """A fault answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self, path: str = "") -> JSONResponse:
        """The answer in the shape of the API `path` belongs to: Anthropic's on /v1/messages, OpenAI's elsewhere."""
        body = anthropic_error_object(self.status, self.message) if speaks_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = INVALID_REQUEST, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object; the message cut to MAX_MESSAGE_CHARS, and the param (a field name the client sent) to
    a short prefix."""
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS - len(CUT_MARK)] + CUT_MARK
    return {"error": {"message": message, "type": type, "param": None if param is None else short_name(param),
                      "code": code}}


def too_large(message: str, code: str) -> ApiError:
    return ApiError(413, message, code=code)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    exc.message = shortened(exc.message, *_sent_in_url(request))
    return exc.response(request.url.path)


def _sent_in_url(request: Request) -> list[str]:
    """What the client sent in the URL (an id, a model's name, a query's values), which a message may quote."""
    return [*request.path_params.values(), *request.query_params.values()]


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own faults (no such route, a method the route lacks) in OpenAI's format and words."""
    message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) else exc.detail
    return ApiError(exc.status_code, message or "", headers=exc.headers).response(request.url.path)


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    param = next(iter(request.path_params), None)
    return ApiError(404, shortened(str(exc), *_sent_in_url(request)), param=param).response(request.url.path)


async def _bad_batch(request: Request, exc: BatchInputError) -> JSONResponse:
    return ApiError(400, str(exc)).response()


async def _queue_full(request: Request, exc: QueueFull) -> JSONResponse:
    return ApiError(429, f"The queue is full; try again later ({exc})", code="queue_full").response(request.url.path)


async def _file_too_large(request: Request, exc: FileTooLarge) -> JSONResponse:
    return too_large(str(exc), exc.code).response(request.url.path)


async def _redis_unreachable(request: Request, exc: Exception) -> JSONResponse:
    log.warning("cannot reach Redis: %s", exc)
    return ApiError(503, "The gateway cannot reach Redis; try again later.", type=SERVER_ERROR,
                    code="redis_unreachable").response(request.url.path)


async def _not_replicated(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s", exc)
    return ApiError(503, "The request was queued, but no Redis replica confirmed it in time; it may be lost if Redis "
                    "fails over now.", type=SERVER_ERROR, code="not_replicated").response(request.url.path)


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    return ApiError(500, "The gateway failed to handle the request.", type=SERVER_ERROR).response(request.url.path)


EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    HTTPException: _http_error,
    BatchNotFound: _not_found,
    FileNotFound: _not_found,
    BatchInputError: _bad_batch,
    QueueFull: _queue_full,
    FileTooLarge: _file_too_large,
    RedisConnectionError: _redis_unreachable,
    RedisTimeoutError: _redis_unreachable,
    NotReplicated: _not_replicated,
    Exception: _internal,
}
