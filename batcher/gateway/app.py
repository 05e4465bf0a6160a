"""The gateway's Starlette application: its routes, its error handlers and its middleware.

`create_app` takes its Redis connections (a sync one for the core API, run in threads, and an asyncio one
for the streams it follows), so that tests can hand it fakeredis. At its start it publishes its tenants' limits
(`batcher tenants` reads them), and while it runs it renews the leases of its requests' concurrency slots.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rqbatcher.batches.file_store import FileLimits, FileStore
from rqbatcher.client import DEFAULT_MAX_QUEUE_LENGTH, Client
from rqbatcher.gateway import (
    batch_routes,
    completions,
    embedding_routes,
    file_routes,
    message_routes,
    response_routes,
    tokenize_routes,
)
from rqbatcher.gateway.auth import ApiKeys, AuthMiddleware
from rqbatcher.gateway.defaults import DEFAULT_MAX_REQUEST_BYTES
from rqbatcher.gateway.error_objects import EXCEPTION_HANDLERS, SERVER_ERROR, ApiError
from rqbatcher.gateway.http_metrics import GatewayMetrics, MetricsMiddleware
from rqbatcher.gateway.job_service import JobService
from rqbatcher.gateway.tenant_admission import AdmissionMiddleware, TenantAdmission
from rqbatcher.gateway.tenant_limits import OPEN_TENANT, Limits, TenantLimits, publish
from rqbatcher.jobs import keys

MODEL_OWNER = "batcher"


@dataclass(frozen=True)
class GatewayConfig:
    queue: str = keys.DEFAULT_QUEUE
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    file_limits: FileLimits = field(default_factory=FileLimits)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queue_length: int | None = DEFAULT_MAX_QUEUE_LENGTH
    default_limits: Limits = field(default_factory=Limits)  # every tenant's, unless its line in the keys file says


def _model_json(name: str) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": MODEL_OWNER}


async def list_models(request: Request) -> JSONResponse:
    served = await run_in_threadpool(request.app.state.jobs.served_models)
    return JSONResponse({"object": "list", "data": [_model_json(m) for m in served]})


async def retrieve_model(request: Request) -> JSONResponse:
    name = request.path_params["model"]
    if name not in await run_in_threadpool(request.app.state.jobs.served_models):
        raise ApiError(404, f"No live worker serves the model `{name}`.", param="model", code="model_not_found")
    return JSONResponse(_model_json(name))


async def health(request: Request) -> JSONResponse:
    try:
        await request.app.state.aconnection.ping()
    except Exception:  # noqa: BLE001  (any failure to answer is unhealthy)
        raise ApiError(503, "Redis is unreachable.", type=SERVER_ERROR, code="redis_unreachable") from None
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


ROUTES = [
    Route("/v1/files", file_routes.create_file, methods=["POST"]),
    Route("/v1/files/{file_id}", file_routes.retrieve_file, methods=["GET"]),
    Route("/v1/files/{file_id}", file_routes.delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_routes.file_content, methods=["GET"]),
    Route("/v1/batches", batch_routes.create_batch, methods=["POST"]),
    Route("/v1/batches", batch_routes.list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", batch_routes.retrieve_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", batch_routes.cancel_batch, methods=["POST"]),
    Route("/v1/completions", completions.completions, methods=["POST"]),
    Route("/v1/chat/completions", completions.chat_completions, methods=["POST"]),
    Route("/v1/embeddings", embedding_routes.create_embeddings, methods=["POST"]),
    Route("/v1/messages", message_routes.create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", message_routes.count_tokens, methods=["POST"]),
    Route("/v1/responses", response_routes.create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", response_routes.retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", response_routes.delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/cancel", response_routes.cancel_response, methods=["POST"]),
    Route("/v1/responses/{response_id}/input_items", response_routes.list_input_items, methods=["GET"]),
    Route("/tokenize", tokenize_routes.tokenize, methods=["POST"]),
    Route("/detokenize", tokenize_routes.detokenize, methods=["POST"]),
    Route("/v1/tokenize", tokenize_routes.tokenize, methods=["POST"]),
    Route("/v1/detokenize", tokenize_routes.detokenize, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    async with anyio.create_task_group() as group:
        group.start_soon(app.state.admission.keep_leases)
        yield
        group.cancel_scope.cancel()


def create_app(config: GatewayConfig, connection: Redis, aconnection: AsyncRedis,
               registry: CollectorRegistry | None = None) -> Starlette:
    gateway_metrics = GatewayMetrics(registry or CollectorRegistry())
    limits = TenantLimits(config.default_limits, config.api_keys.limit_overrides)
    tenants = config.api_keys.tenants or [OPEN_TENANT]
    admission = TenantAdmission(connection, aconnection, limits, config.queue, gateway_metrics.rate_limited)
    app = Starlette(routes=ROUTES, exception_handlers=EXCEPTION_HANDLERS, lifespan=_lifespan, middleware=[
        Middleware(MetricsMiddleware, metrics=gateway_metrics, routes=ROUTES),
        Middleware(AuthMiddleware, keys=config.api_keys),
        Middleware(AdmissionMiddleware, admission=admission),
    ])
    publish(connection, limits, tenants)
    gateway_metrics.show_limits({tenant: limits.of(tenant) for tenant in tenants})
    app.state.config = config
    app.state.client = Client(connection, queue=config.queue, max_queue_length=config.max_queue_length)
    app.state.responses_client = response_routes.responses_client(connection, config.queue, config.max_queue_length)
    app.state.files = FileStore(connection, config.file_limits)
    app.state.aconnection = aconnection
    app.state.admission = admission
    app.state.jobs = JobService(app.state.client, aconnection, admission)
    app.state.metrics = gateway_metrics
    return app
