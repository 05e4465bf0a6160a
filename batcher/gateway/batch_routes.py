"""/v1/batches: a batch created from an uploaded file through the core API (`Client.create_batch`), read,
listed newest first, and cancelled. Each tenant sees only its own: another tenant's id is not found. A batch whose
lines would pass its tenant's max-queued-batch-lines is refused whole (429) before any line is enqueued
(batcher/gateway/tenant_admission.py)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from rqbatcher.batches.batch_object import (
    DEFAULT_COMPLETION_WINDOW,
    Batch,
    BatchInputError,
    check_metadata,
    parse_output_expiry,
)
from rqbatcher.batches.file_store import FileNotFound, FileStore
from rqbatcher.client import Client
from rqbatcher.errors import names, quoted, shortened
from rqbatcher.gateway.body import read_json
from rqbatcher.gateway.error_objects import ApiError
from rqbatcher.gateway.numbers import number_of
from rqbatcher.openai.batch_endpoints import ENDPOINTS

DEFAULT_LIST_LIMIT = 20  # OpenAI's page size and its bounds
MAX_LIST_LIMIT = 100
CREATE_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
HIDDEN_FIELDS = {"owner", "queue", "output_expires_at"}


def batch_json(batch: Batch) -> dict:
    return batch.model_dump(mode="json", exclude=HIDDEN_FIELDS)


async def create_batch(request: Request) -> JSONResponse:
    body = await read_json(request, request.app.state.config.max_request_bytes)
    unknown = set(body) - CREATE_FIELDS
    if unknown:
        raise ApiError(400, f"unsupported fields: {names(unknown)}", param=min(unknown))
    file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    if not isinstance(file_id, str):
        raise ApiError(400, "input_file_id is required: the id of a file uploaded with purpose batch",
                       param="input_file_id")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}; got {quoted(endpoint)}", param="endpoint")
    window = body.get("completion_window", DEFAULT_COMPLETION_WINDOW)
    if window != DEFAULT_COMPLETION_WINDOW:  # OpenAI's only window (`Client.create_batch` takes others)
        raise ApiError(400, f"completion_window is {DEFAULT_COMPLETION_WINDOW}; got {quoted(window)}",
                       param="completion_window")
    try:
        check_metadata(body.get("metadata"))
    except BatchInputError as exc:
        raise ApiError(400, str(exc), param="metadata") from None
    try:
        output_expires_s = parse_output_expiry(body.get("output_expires_after"))
    except BatchInputError as exc:
        raise ApiError(400, str(exc), param="output_expires_after") from None
    tenant = request.state.tenant
    store: FileStore = request.app.state.files
    client: Client = request.app.state.client
    try:
        uploaded = await run_in_threadpool(store.get, file_id, tenant)
    except FileNotFound as exc:
        raise ApiError(404, f"input_file_id: {shortened(str(exc), file_id)}", param="input_file_id") from None
    if uploaded.purpose != "batch":
        raise ApiError(400, f"file {file_id} was uploaded for {uploaded.purpose}, not batch", param="input_file_id")
    admission = request.app.state.admission
    reservation = await run_in_threadpool(admission.reserve_batch, tenant, uploaded.lines)
    try:
        created = await run_in_threadpool(lambda: client.create_batch(
            store.lines(file_id), endpoint=endpoint, completion_window=window, metadata=body.get("metadata"),
            owner=tenant, input_file_id=file_id, output_expires_s=output_expires_s))
    finally:
        await run_in_threadpool(admission.release_batch, tenant, reservation)
    return JSONResponse(batch_json(created))


async def retrieve_batch(request: Request) -> JSONResponse:
    client: Client = request.app.state.client
    found = await run_in_threadpool(client.batch, request.path_params["batch_id"], request.state.tenant)
    return JSONResponse(batch_json(found))


async def cancel_batch(request: Request) -> JSONResponse:
    client: Client = request.app.state.client
    cancelled = await run_in_threadpool(client.cancel_batch, request.path_params["batch_id"], request.state.tenant)
    return JSONResponse(batch_json(cancelled))


async def list_batches(request: Request) -> JSONResponse:
    client: Client = request.app.state.client
    raw_limit = request.query_params.get("limit", str(DEFAULT_LIST_LIMIT))
    limit = number_of(raw_limit)
    if limit is None or not 1 <= limit <= MAX_LIST_LIMIT:
        raise ApiError(400, f"limit is 1 to {MAX_LIST_LIMIT}; got {quoted(raw_limit)}", param="limit")
    after = request.query_params.get("after")
    found = await run_in_threadpool(client.batches, request.state.tenant, after, limit + 1)
    page = found[:limit]
    return JSONResponse({"object": "list", "data": [batch_json(b) for b in page],
                         "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                         "has_more": len(found) > limit})
