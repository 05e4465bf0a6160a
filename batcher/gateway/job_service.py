"""The gateway's job service: what every route does with a job, so that the routes only speak HTTP.

A request's model is checked against the live workers of the gateway's queue (404 `model_not_found` unless one
serves it), then its job is enqueued; its end is read from the job's Redis stream, whose `done` event carries the
whole result, so a request that waits for its answer reads Redis once (the stored result is read only when the
stream was lost). A client that goes away before its job ends cancels the job. A job is enqueued only once its
tenant's limits admit it (batcher/gateway/tenant_admission.py): 429 otherwise; the usage its end reports is noted on
the request, whose admission is settled by it when the HTTP request ends.

The live workers are read (SMEMBERS plus an HGETALL each) at most once every LIVE_WORKERS_TTL_S per process, so a
busy gateway reads them once, not once a request. A model missing from that view is looked up again at once before
the 404, so a worker that has just started serves its first request; one that died is noticed that much later.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import aclosing

import anyio
from pydantic import ValidationError
from redis.asyncio import Redis as AsyncRedis
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from rqbatcher.client import Client, JobFailed
from rqbatcher.errors import readable, short_name
from rqbatcher.gateway import job_streams
from rqbatcher.gateway.error_objects import NO_RETRY, SERVER_ERROR, ApiError
from rqbatcher.gateway.tenant_admission import ADMISSION_FIELD, TenantAdmission, note_usage
from rqbatcher.jobs.admin import list_workers
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.logit_bias import token_ids_problem
from rqbatcher.schema import GenerationRequest, GenerationResult, StreamEvent

log = logging.getLogger(__name__)

RESULT_WAIT_S = 30.0  # the result is recorded with the stream's end; this only bounds a Redis hiccup
LIVE_WORKERS_TTL_S = 1.0  # how stale the gateway's view of the live workers may be
CANCELLED_MESSAGE = "The request was cancelled before it finished."
FAILED_CODE = "generation_failed"  # a failed job's answer (its reason is the worker's)
ANSWER_FIELDS = ("sampling", "response_format", "regex", "choice", "echo")  # a request's, that its prompt does not read


class JobService:
    """Submit, follow, wait for and cancel the jobs of one gateway process, on its queue."""

    def __init__(self, client: Client, aconnection: AsyncRedis, admission: TenantAdmission) -> None:
        self.client = client
        self.aconnection = aconnection
        self.admission = admission
        self._live: list[WorkerStats] = []
        self._live_read_at = -LIVE_WORKERS_TTL_S
        self._live_lock = threading.Lock()

    # ----- the live workers and their models (sync: run in a thread) -----
    def live_workers(self, *, fresh: bool = False) -> list[WorkerStats]:
        """The live workers of the queue, as read at most LIVE_WORKERS_TTL_S ago (now, if `fresh`)."""
        with self._live_lock:
            if fresh or time.monotonic() - self._live_read_at >= LIVE_WORKERS_TTL_S:
                queue = self.client.queue
                self._live = [w for w in list_workers(self.client.connection) if queue in w.queues.split(",")]
                self._live_read_at = time.monotonic()
            return self._live

    def served_models(self) -> list[str]:
        """The models that live workers of the queue serve."""
        return sorted({w.model for w in self.live_workers()})

    def served_model(self, request: GenerationRequest) -> str:
        """The model the request runs on; 404 model_not_found unless a live worker of the queue serves it, and 400
        if a token id it gives (logit_bias, prompt, input) is outside that model's vocabulary, as its workers publish
        it."""
        return self.serving(request)[1]

    def serving(self, request: GenerationRequest) -> tuple[list[WorkerStats], str]:
        """The live workers and the model the request runs on (`served_model_among`); a model missing from the
        cached view is looked up again before the 404."""
        live = self.live_workers()
        try:
            return live, served_model_among(live, request)
        except ApiError as exc:
            if exc.status != 404:
                raise
        live = self.live_workers(fresh=True)
        return live, served_model_among(live, request)

    def submit(self, request: GenerationRequest, state=None) -> tuple[str, str]:
        """(the model it runs on, the job id): one thread hop for both, since each hop costs time to first token.
        `state`: the HTTP request's (its tenant), for its tenant's limits."""
        model = self.served_model(request)
        return model, self.enqueue(request, state)

    def enqueue(self, request: GenerationRequest, state=None, *, client: Client | None = None,
                job_id: str | None = None) -> str:
        """Enqueue the request's job, as its HTTP request's tenant's (fair share between tenants:
        batcher/jobs/fairness.py), once the tenant's limits admit it (RateLimited, a 429, otherwise); the admission
        is kept on the HTTP request's `state`."""
        tenant = getattr(state, "tenant", None)
        if tenant is not None:
            request = request.model_copy(update={"tenant": tenant})
        admitted = None if state is None else self.admission.admit(tenant, request)
        if admitted is not None:
            setattr(state, ADMISSION_FIELD, admitted)
        try:
            return (client or self.client).submit(request, job_id=job_id)
        except Exception:
            if admitted is not None:
                admitted.used = 0  # nothing was enqueued: the reservation is given back
            raise

    # ----- following a job (async) -----
    async def events(self, job_id: str, state=None):
        """The job's stream events, up to its end (batcher/gateway/job_streams.py); the usage its end reports is noted
        on the HTTP request's `state`."""
        async with aclosing(job_streams.events(self.aconnection, self.client, job_id)) as events:
            async for event in events:
                if event.type == "done" and state is not None:
                    note_usage(state, event.usage)
                yield event

    async def cancel(self, job_id: str, client: Client | None = None) -> None:
        """Cancel a job whose client went away; shielded, since that is when the caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            try:
                await run_in_threadpool((client or self.client).cancel, job_id)
            except Exception:  # noqa: BLE001  (the job ended or expired meanwhile: nothing to stop)
                log.debug("job %s: cancel after the client left did nothing", job_id, exc_info=True)

    async def wait_for_end(self, request: Request, job_id: str, client: Client | None = None) -> StreamEvent | None:
        """The job's terminal event, or None if the HTTP client left first (the job is then cancelled)."""
        end, failure = None, None
        async with anyio.create_task_group() as group:
            async def watch_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch_disconnect)
            try:
                async for event in self.events(job_id):
                    end = event if event.terminal else end
            except Exception as exc:  # noqa: BLE001  (raised below, outside the group, which would wrap it)
                failure = exc
            finally:
                if end is None:
                    await self.cancel(job_id, client)
            group.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return end

    async def result_when_ended(self, request: Request, job_id: str, client: Client | None = None) -> GenerationResult:
        """The job's result once it ends, from its `done` event; ApiError when the HTTP client left, or the job failed
        or was cancelled."""
        end = await self.wait_for_end(request, job_id, client)
        if end is None:  # the client left; nobody reads this
            raise ApiError(499, CANCELLED_MESSAGE, code="client_closed_request")
        if end.type == "error":
            raise ApiError(400, end.error or "the request failed", code=FAILED_CODE)
        if end.result is not None and end.finish_reason != "cancelled":
            result = end.result
        else:
            result = await self.stored_result(job_id, client)
        note_usage(request.state, result.usage)
        return result

    async def tokenize(self, request: Request, generation: GenerationRequest) -> GenerationResult:
        """The prompt of `generation` as a worker of its model renders it, with nothing generated (`tokenize_job`):
        its ids in the result's `prompt_token_ids` (their count in `usage.prompt_tokens`) and, where it gave token
        ids, their text in `text`. The job is routed, limited and waited for as any (404 model_not_found, 429, 400
        with the worker's reason)."""
        job = tokenize_job(generation)
        _, job_id = await run_in_threadpool(self.submit, job, request.state)
        return await self.result_when_ended(request, job_id)

    async def stored_result(self, job_id: str, client: Client | None = None) -> GenerationResult:
        """The job's recorded result, for an end whose event does not carry it (a lost or inferred stream end)."""
        try:
            return await run_in_threadpool((client or self.client).result, job_id, RESULT_WAIT_S)
        except JobFailed as exc:
            if exc.status == "failed":
                raise ApiError(400, exc.reason, code=FAILED_CODE) from None
            raise ApiError(500, CANCELLED_MESSAGE, type=SERVER_ERROR, code="cancelled", headers=NO_RETRY) from None


def tokenize_job(generation: GenerationRequest) -> GenerationRequest:
    """The tokenize_only job of `generation`: what shapes only its answer (ANSWER_FIELDS) is dropped, so its prompt
    is counted as a generation of it would read it."""
    try:
        return GenerationRequest.model_validate(generation.model_dump(mode="json", exclude=set(ANSWER_FIELDS))
                                                | {"tokenize_only": True})
    except ValidationError as exc:
        raise ApiError(400, readable(exc)) from None


def served_model_among(live: list[WorkerStats], request: GenerationRequest) -> str:
    """`JobService.served_model`, among the live workers of the queue already read."""
    served = sorted({w.model for w in live})
    if request.model is None and served:
        model = served[0] if len(served) == 1 else ""
    elif request.model in served:
        model = request.model
    else:
        offered = f"the models served now: {', '.join(served)}" if served else "no worker is serving any model now"
        name = "any model" if request.model is None else f"the model `{short_name(request.model)}`"
        raise ApiError(404, f"No live worker serves {name} ({offered}).", param="model", code="model_not_found")
    sizes = sorted({w.vocab_size for w in live if w.model == model or not model})
    problem = next(filter(None, (token_ids_problem(request, size) for size in sizes)), None)
    if problem is not None:
        raise ApiError(400, problem[1], param=problem[0])
    return model
