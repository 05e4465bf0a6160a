"""The endpoints a batch line may name, each with how its body becomes a job and how its finished job becomes the
output line: chat completions and completions (generation_body.py and generation_answer.py), responses
(responses/responses_body.py) and embeddings (embeddings_body.py). The line's envelope (custom_id, method, url)
is read in batch_lines.parse_batch_line.
"""

from __future__ import annotations

from typing import Any

from rqbatcher.openai.batch_lines import parse_batch_line, success_line
from rqbatcher.openai.embeddings_body import (
    DEFAULT_ENCODING_FORMAT,
    EMBEDDINGS_URL,
    embeddings_object,
    encoding_format_of,
    parse_embeddings_body,
)
from rqbatcher.openai.generation_answer import response_body
from rqbatcher.openai.generation_body import CHAT_URL, COMPLETIONS_URL, parse_body
from rqbatcher.openai.responses.responses_body import (
    RESPONSE_ID_PREFIX,
    RESPONSES_URL,
    finished_status,
    parse_responses_body,
    response_object,
)
from rqbatcher.openai.service_tiers import TIER_OF_CLASS
from rqbatcher.schema import GenerationRequest, GenerationResult
from rqbatcher.service_class import BATCH

ENDPOINTS = (COMPLETIONS_URL, CHAT_URL, RESPONSES_URL, EMBEDDINGS_URL)


def parse_line_body(body: Any, url: str) -> GenerationRequest:
    """The job of a batch line's body for its endpoint `url` (one of ENDPOINTS); BodyError with the reason."""
    if url == RESPONSES_URL:
        return parse_responses_body(body, batch_line=True)
    if url == EMBEDDINGS_URL:
        return parse_embeddings_body(body)
    return parse_body(body, url)


def parse_line(line: str, endpoint: str | None = None) -> tuple[str | None, GenerationRequest, dict]:
    """(custom_id, request, the BatchItem fields the line sets) of a batch line of any endpoint
    (batch_lines.parse_batch_line says how): its url, and an embeddings line's encoding_format, which the
    worker that writes its output line reads from the job's BatchItem."""
    item_fields = {}

    def parse(body: Any, url: str) -> GenerationRequest:
        item_fields["url"] = url
        if url == EMBEDDINGS_URL and isinstance(body, dict) and encoding_format_of(body) != DEFAULT_ENCODING_FORMAT:
            item_fields["encoding_format"] = encoding_format_of(body)
        return parse_line_body(body, url)

    custom_id, request = parse_batch_line(line, endpoint, parse, ENDPOINTS)
    return custom_id, request, item_fields


def endpoint_of(request: GenerationRequest) -> str:
    """A batch job's endpoint: its line's url, or (a job enqueued before lines carried it) chat for messages and
    completions otherwise."""
    url = request.batch.url if request.batch is not None else None
    return url or (CHAT_URL if request.messages is not None else COMPLETIONS_URL)


def output_line(custom_id: str | None, result: GenerationResult, request: GenerationRequest, *, job_id: str,
                created: int) -> dict:
    """The output line of a finished batch job: its body is the endpoint's OpenAI object (a response for
    /v1/responses, the embeddings list for /v1/embeddings), as the gateway answers it over HTTP."""
    url = endpoint_of(request)
    if url == RESPONSES_URL:
        body = response_object(request, result, response_id=f"{RESPONSE_ID_PREFIX}{job_id}", created_at=created,
                               status=finished_status(result))
    elif url == EMBEDDINGS_URL:
        body = embeddings_object(result, request, request.batch.encoding_format or DEFAULT_ENCODING_FORMAT)
    else:
        body = response_body(result, url, job_id, created, TIER_OF_CLASS[BATCH], request)
    return success_line(custom_id, body, job_id)
