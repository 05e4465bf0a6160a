"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the same jobs as chat completions.

The body is read by rqbatcher.anthropic_messages (into a GenerationRequest), the job is submitted, awaited or
relayed as the chat endpoint does (batcher/gateway/completions.py), and its answer written as Anthropic's Message or
event stream; every error on these paths takes Anthropic's shape (error_objects.py). `thinking` enabled needs a model
that reasons: the worker says how its model writes (the job's chat_format, on its `start` event and its result), so a
model without reasoning markers answers 400 (a stream: an error event, before message_start). count_tokens runs a
tokenize-only job: only the worker has the model's tokenizer and chat template.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from rqbatcher.anthropic_messages.anthropic_errors import error_event
from rqbatcher.anthropic_messages.message_object import message_object
from rqbatcher.anthropic_messages.request_body import (
    InvalidBody,
    parse_count_tokens_body,
    parse_messages_body,
)
from rqbatcher.anthropic_messages.stream_events import MessageEvents
from rqbatcher.gateway import job_streams
from rqbatcher.gateway.body import read_parsed
from rqbatcher.gateway.completions import EventStreamResponse
from rqbatcher.gateway.error_objects import ApiError
from rqbatcher.gateway.job_service import CANCELLED_MESSAGE
from rqbatcher.schema import ChatFormat

THINKING_UNSUPPORTED = "thinking is not supported by this model: it does not mark its reasoning"
FAILED_MESSAGE = "the request failed"


async def create_message(request: Request):
    parsed = await read_parsed(request, parse_messages_body, InvalidBody)
    generation = parsed.generation
    jobs = request.app.state.jobs
    model, job_id = await run_in_threadpool(jobs.submit, generation, request.state)
    if parsed.stream:
        events = MessageEvents(job_id, model, generation)
        return EventStreamResponse(_relay(request, job_id, events, parsed.thinking))
    result = await jobs.result_when_ended(request, job_id)
    if parsed.thinking and not reasons(result.chat_format):
        raise ApiError(400, THINKING_UNSUPPORTED, param="thinking")
    return JSONResponse(message_object(result, job_id, model, generation))


async def count_tokens(request: Request) -> JSONResponse:
    generation = await read_parsed(request, parse_count_tokens_body, InvalidBody)
    result = await request.app.state.jobs.tokenize(request, generation)  # the tenant's job
    return JSONResponse({"input_tokens": result.usage.prompt_tokens})


def reasons(chat_format: ChatFormat | None) -> bool:
    """Whether the model marks its reasoning (so `thinking` can be honoured)."""
    return chat_format is not None and chat_format.reasoning is not None


async def _relay(request: Request, job_id: str, events: MessageEvents, thinking: bool) -> AsyncIterator[bytes]:
    """The job's stream as Anthropic's events; a client that leaves before the end cancels the job."""
    app = request.app
    app.state.metrics.streams.inc()
    ended = False
    relay = job_streams.TextRelay()
    try:
        async for event in app.state.jobs.events(job_id, request.state):
            if event.type == "start" and thinking and not reasons(event.chat_format):
                yield error_event(400, THINKING_UNSUPPORTED)
                return
            if event.type == "start" and event.chat_format is not None:
                events.read_as(event.chat_format)
            elif event.type == "restart":
                relay.restart()
            elif event.type == "token":
                delta = relay.delta(event)
                for chunk in ([] if events.started else events.start(event.usage)) + events.text(delta):
                    yield chunk
            elif event.type == "done":
                relay.check_end()
                ended = True
                if event.finish_reason == "cancelled":
                    yield error_event(500, CANCELLED_MESSAGE)
                    return
                stop_sequence = None if event.result is None else event.result.stop_sequence
                for chunk in ([] if events.started else events.start(event.usage)) + events.finish(
                        event.finish_reason, stop_sequence, event.usage):
                    yield chunk
            elif event.type == "error":
                ended = True
                yield error_event(400, event.error or FAILED_MESSAGE)
    except job_streams.AttemptDiverged as exc:
        yield error_event(500, str(exc))
    finally:
        app.state.metrics.streams.dec()
        if not ended:
            await app.state.jobs.cancel(job_id)
