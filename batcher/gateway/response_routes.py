"""/v1/responses (OpenAI's Responses API): each response is one ordinary job, `background` or not.

Its id is `resp_` and its job's id, so a response is found from its job and back. A stored response (`store`, the
default) keeps a record in Redis with its tenant (batcher/gateway/response_records.py), and its job is enqueued with a
result and stream TTL as long as the record's retention, so its output and its event stream outlive neither.
A background response is answered at once (`queued`); its job runs, is rerun after a crash, is fair-shared and
shows in `batcher status` as any job. Its events are built from the job's Redis stream alone
(batcher/gateway/response_events.py), so `GET /v1/responses/{id}?stream=true&starting_after=N` resumes them
after a lost connection or a gateway restart. A client that leaves cancels a response's job unless it runs in
the background. `previous_response_id` continues a stored response of the same tenant: its conversation and
output come before the new input (its instructions are not carried over, as in OpenAI).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from redis import Redis
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from rqbatcher.client import Client, JobNotFound
from rqbatcher.errors import quoted, shortened
from rqbatcher.gateway.body import read_json
from rqbatcher.gateway.completions import EventStreamResponse
from rqbatcher.gateway.error_objects import ApiError
from rqbatcher.gateway.job_service import RESULT_WAIT_S
from rqbatcher.gateway.numbers import number_of
from rqbatcher.gateway.response_events import ResponseEvents, sse
from rqbatcher.gateway.response_records import (
    DEFAULT_RESPONSE_RETENTION_S,
    ResponseNotFound,
    ResponseRecord,
    ResponseRecords,
)
from rqbatcher.openai.generation_body import BodyError
from rqbatcher.openai.responses.response_items import answer_messages, input_items
from rqbatcher.openai.responses.responses_body import (
    RESPONSE_ID_PREFIX,
    echo_fields,
    finished_status,
    parse_responses_body,
    previous_response_of,
    response_object,
)
from rqbatcher.schema import ChatMessage, GenerationRequest, GenerationResult

JOB_STATUSES = {"queued": "queued", "deferred": "queued", "scheduled": "queued", "started": "in_progress",
                "canceled": "cancelled", "stopped": "cancelled", "failed": "failed"}  # RQ's -> OpenAI's
FINISHED_STATUSES = ("completed", "incomplete")
DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT = 20, 100  # OpenAI's for input_items


def responses_client(connection: Redis, queue: str, max_queue_length: int | None) -> Client:
    """The gateway's client for stored responses: their jobs' results and streams are kept as long as the records."""
    return Client(connection, queue=queue, max_queue_length=max_queue_length,
                  result_ttl=DEFAULT_RESPONSE_RETENTION_S, failure_ttl=DEFAULT_RESPONSE_RETENTION_S)


def _client(request: Request) -> Client:
    return request.app.state.responses_client


def _records(request: Request) -> ResponseRecords:
    return ResponseRecords(request.app.state.client.connection)


async def _record(request: Request, response_id: str, param: str | None = None) -> ResponseRecord:
    """The tenant's stored response; 404 otherwise, naming the body field `param` that gave its id, if one did."""
    try:
        return await run_in_threadpool(_records(request).get, response_id, request.state.tenant)
    except ResponseNotFound as exc:
        message = shortened(str(exc), response_id)
        raise ApiError(404, message if param is None else f"{param}: {message}", param=param,
                       code="not_found") from None


# ----- POST /v1/responses -----
async def create_response(request: Request):
    body = await read_json(request, request.app.state.config.max_request_bytes)
    try:
        previous = previous_response_of(body)
        conversation = [] if previous is None else await _conversation_after(request, previous)
        generation = parse_responses_body(body, conversation=conversation)
    except BodyError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    job_id = uuid.uuid4().hex  # letters and digits: a job id and a response id's suffix alike
    response_id = RESPONSE_ID_PREFIX + job_id
    echo = echo_fields(body)
    if echo["background"]:  # its end is announced to its tenant's webhooks
        generation = generation.model_copy(update={"background_response": response_id})
    created = int(time.time())
    model = await run_in_threadpool(_start, request, generation, job_id, body, echo, created)
    render = {"response_id": response_id, "created_at": created, **echo, "model": model}
    if body.get("stream"):
        return EventStreamResponse(_events(request, generation, render, after=-1, cancels=not echo["background"]))
    if echo["background"]:
        return JSONResponse(response_object(generation, None, status="queued", **render))
    result = await request.app.state.jobs.result_when_ended(request, job_id)
    return JSONResponse(response_object(generation, result, status=finished_status(result), **render))


def _start(request: Request, generation: GenerationRequest, job_id: str, body: dict, echo: dict,
           created: int) -> str:
    """Check the model, store the record (before the job can end), enqueue; the model it runs on. A response
    that is not stored keeps its job's result and stream only as long as any job's."""
    client = _client(request) if echo["store"] else request.app.state.client
    model = request.app.state.jobs.served_model(generation)
    records = _records(request)
    record = ResponseRecord(id=RESPONSE_ID_PREFIX + job_id, tenant=request.state.tenant, created_at=created,
                            model=model, request=generation, echo=echo,
                            input_items=input_items(body.get("input") or [], job_id))
    if echo["store"]:
        records.save(record)
    try:
        request.app.state.jobs.enqueue(generation, request.state, client=client, job_id=job_id)  # 429 past limits
    except Exception:
        if echo["store"]:
            records.delete(record.id, record.tenant)
        raise
    return model


async def _conversation_after(request: Request, response_id: str) -> list[ChatMessage]:
    """A stored response's conversation and its answer, for a response that goes on from it."""
    record = await _record(request, response_id, param="previous_response_id")
    status, result, _ = await run_in_threadpool(_job_state, _client(request), record.job_id)
    if status not in FINISHED_STATUSES:
        raise ApiError(400, f"Previous response {response_id} is {status}; only a finished one can be continued.",
                       param="previous_response_id")
    return record.conversation + answer_messages(record.request, result, record.job_id)


def _job_state(client: Client, job_id: str) -> tuple[str, GenerationResult | None, dict | None]:
    """(the response's status, its result once finished, its error once failed) from its job."""
    try:
        info = client.status(job_id)
    except JobNotFound:
        return "failed", None, {"code": "server_error", "message": "The response's job has expired."}
    if info.status == "finished":
        result = client.result(job_id, RESULT_WAIT_S)
        return finished_status(result), result, None
    status = JOB_STATUSES.get(info.status, "in_progress")
    error = {"code": "server_error", "message": info.error or "the request failed"} if status == "failed" else None
    return status, None, error


async def _events(request: Request, generation: GenerationRequest, render: dict, after: int,
                  cancels: bool) -> AsyncIterator[bytes]:
    """The response's events numbered above `after`, from its job's stream read from the start."""
    app = request.app
    builder = ResponseEvents(generation, **render)
    job_id = render["response_id"].removeprefix(RESPONSE_ID_PREFIX)
    app.state.metrics.streams.inc()
    try:
        for event in builder.opening():
            if event["sequence_number"] > after:
                yield sse(event)
        async with aclosing(app.state.jobs.events(job_id, request.state)) as job_events:
            async for job_event in job_events:
                for event in builder.feed(job_event):
                    if event["sequence_number"] > after:
                        yield sse(event)
                if builder.ended:  # the job's end, or a rerun that diverged from the text already sent
                    break
    finally:
        app.state.metrics.streams.dec()
        if cancels and not builder.ended:
            await app.state.jobs.cancel(job_id, _client(request))


# ----- a stored response -----
def _render(record: ResponseRecord) -> dict:
    return {"response_id": record.id, "created_at": record.created_at, **record.echo, "model": record.model}


async def retrieve_response(request: Request):
    record = await _record(request, request.path_params["response_id"])
    if request.query_params.get("stream", "false").lower() == "true":
        after = number_of(request.query_params.get("starting_after", "-1"))
        if after is None:
            raise ApiError(400, "starting_after is a sequence number", param="starting_after")
        return EventStreamResponse(_events(request, record.request, _render(record), after, cancels=False))
    status, result, error = await run_in_threadpool(_job_state, _client(request), record.job_id)
    return JSONResponse(response_object(record.request, result, status=status, error=error, **_render(record)))


async def cancel_response(request: Request):
    record = await _record(request, request.path_params["response_id"])
    if not record.echo.get("background"):
        raise ApiError(400, "Only a background response can be cancelled.", param="response_id")
    client = _client(request)
    cancelled = await run_in_threadpool(_cancel_job, client, record.job_id)
    if cancelled:
        return JSONResponse(response_object(record.request, None, status="cancelled", **_render(record)))
    status, result, error = await run_in_threadpool(_job_state, client, record.job_id)
    return JSONResponse(response_object(record.request, result, status=status, error=error, **_render(record)))


def _cancel_job(client: Client, job_id: str) -> bool:
    try:
        return client.cancel(job_id)
    except JobNotFound:
        return False


async def delete_response(request: Request):
    """Forget the response (and stop its job, if it still runs); its job's data expires with its TTL."""
    response_id = request.path_params["response_id"]
    record = await _record(request, response_id)
    await run_in_threadpool(_records(request).delete, response_id, record.tenant)
    await run_in_threadpool(_cancel_job, _client(request), record.job_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: Request):
    record = await _record(request, request.path_params["response_id"])
    params = request.query_params
    order, after, limit = params.get("order", "desc"), params.get("after"), params.get("limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order is asc or desc", param="order")
    limit = DEFAULT_LIST_LIMIT if limit is None else number_of(limit)
    if limit is None or not 1 <= limit <= MAX_LIST_LIMIT:
        raise ApiError(400, f"limit is 1 to {MAX_LIST_LIMIT}", param="limit")
    items = record.input_items if order == "asc" else record.input_items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"No input item {quoted(after)} in response {record.id}.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
