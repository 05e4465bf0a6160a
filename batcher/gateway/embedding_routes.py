"""POST /v1/embeddings: one prefill-only job per request (all its inputs), answered when it ends.

The body is read and the answer built by `rqbatcher.openai.embeddings_body`, as the endpoint's batch lines are. The
job is routed as a completion is (batcher/gateway/completions.py): 404 `model_not_found` unless a live worker
serves the model. What the live workers publish is checked before anything is queued, since a job no worker can
answer would otherwise fail only once a worker took it: 400 naming `model` when they do not embed, and 400 naming
`dimensions` when they cannot give vectors of that length. A job that fails answers 400 with the worker's reason,
naming `input` when the reason is about one (an input longer than the model's context).
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from rqbatcher.gateway.body import read_json
from rqbatcher.gateway.error_objects import ApiError
from rqbatcher.gateway.job_service import FAILED_CODE, JobService
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.openai.embeddings_body import embeddings_object, encoding_format_of, parse_embeddings_body
from rqbatcher.openai.generation_body import BodyError
from rqbatcher.schema import GenerationRequest

EMBED_TASK = "embed"  # in a worker's published `tasks`
ANY_DIMENSIONS = "any"  # a worker's `matryoshka_dimensions` when it can shorten its vectors to any length
INPUT_WORD = "input"  # a worker's reason about one input starts so (workers/engine/embeddings.py: "input 3 has...")


async def create_embeddings(request: Request) -> JSONResponse:
    app = request.app
    body = await read_json(request, app.state.config.max_request_bytes)
    try:
        generation = parse_embeddings_body(body)
        encoding_format = encoding_format_of(body)
    except BodyError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    job_id = await run_in_threadpool(_enqueue, app.state.jobs, generation, request.state)
    try:
        result = await app.state.jobs.result_when_ended(request, job_id)
    except ApiError as exc:
        if exc.code == FAILED_CODE and exc.message.startswith(INPUT_WORD):
            exc.param = INPUT_WORD
        raise
    return JSONResponse(embeddings_object(result, generation, encoding_format))


def _enqueue(jobs: JobService, request: GenerationRequest, state) -> str:
    """The job id, once the live workers that may take the job can answer it (ApiError otherwise)."""
    live, _ = jobs.serving(request)  # 404 model_not_found
    takers = [w for w in live if request.model is None or w.model == request.model]
    if not all(_embeds(w) for w in takers):
        embedders = sorted({w.model for w in live if _embeds(w)})
        offered = f"models that do: {', '.join(embedders)}" if embedders else "no live worker embeds now"
        who = "Some workers of this queue only generate" if request.model is None else (
            f"The model `{request.model}` only generates")
        raise ApiError(400, f"{who} text: name a model that embeds ({offered}).", param="model")
    if request.dimensions is not None:
        refusing = next((w for w in takers if not _gives_dimensions(w, request.dimensions)), None)
        if refusing is not None:
            raise ApiError(400, _dimensions_refusal(refusing, request.dimensions), param="dimensions")
    return jobs.enqueue(request, state)  # 429 past the tenant's limits


def _embeds(worker: WorkerStats) -> bool:
    return EMBED_TASK in worker.tasks.split(",")


def _gives_dimensions(worker: WorkerStats, dimensions: int) -> bool:
    """Whether the worker's vectors have that length, or shorten to it (Matryoshka)."""
    if dimensions == worker.embedding_size:
        return True
    if worker.matryoshka_dimensions == ANY_DIMENSIONS:
        return dimensions < worker.embedding_size
    return str(dimensions) in worker.matryoshka_dimensions.split(",")


def _dimensions_refusal(worker: WorkerStats, dimensions: int) -> str:
    if worker.matryoshka_dimensions == ANY_DIMENSIONS:
        shorter = "or any length below it"
    elif worker.matryoshka_dimensions:
        shorter = f"or shortened to {worker.matryoshka_dimensions.replace(',', ', ')}"
    else:
        shorter = "and cannot shorten them (it was not trained for Matryoshka embeddings)"
    return (f"dimensions {dimensions} is not available: the model `{worker.model}` gives vectors of "
            f"{worker.embedding_size} dimensions {shorter}.")
