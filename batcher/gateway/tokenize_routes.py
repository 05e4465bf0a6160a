"""POST /tokenize and /detokenize in vLLM's shape (served under /v1/ too, where a client's base URL ends): a prompt
counted as the model will read it before it is sent, and token ids back to text.

The gateway has no tokenizer, so each is a job (`JobService.tokenize`): a worker of the model answers it at admission,
with no model step and no slot, through the same queues, keys, tenants and limits as any job. /tokenize takes vLLM's
completion body (`prompt`) or chat body (`messages`, `tools`, `chat_template_kwargs`) and renders it exactly as a
generation would, so a prompt past the model's context is counted, not refused. vLLM's rendering options are taken
at the values a generation renders with (theirs by default); another value is refused naming it, as are
`return_token_strs: true` (the job answers ids alone) and any field vLLM lacks. `max_model_len` is the context
that the answering worker publishes (batcher/jobs/worker_stats.py). /detokenize decodes `tokens` as the model's
tokenizer does, special tokens kept.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from rqbatcher.errors import dotted
from rqbatcher.gateway.body import read_parsed
from rqbatcher.gateway.error_objects import ApiError
from rqbatcher.gateway.job_service import FAILED_CODE
from rqbatcher.openai.generation_body import BodyError, chat_messages, unknown_fields, validated
from rqbatcher.schema import GenerationRequest, GenerationResult

# vLLM's rendering options, at the values a generation renders its prompt with: the tokenizer's special tokens
# around a prompt; around messages the chat template's alone, ending in its generation prompt
COMPLETION_OPTIONS = {"add_special_tokens": True, "return_token_strs": False}
CHAT_OPTIONS = {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
                "return_token_strs": False}
COMPLETION_FIELDS = {"model", "prompt", *COMPLETION_OPTIONS}
CHAT_FIELDS = {"model", "messages", "tools", "chat_template_kwargs", *CHAT_OPTIONS}
DETOKENIZE_FIELDS = {"model", "tokens"}
TOKEN_IDS_FIELD = "tokens"  # /detokenize's name for the job's prompt_token_ids
TOKEN_STRS_REFUSAL = "return_token_strs: token strings are not available: the worker answers token ids"
UNKNOWN_CONTEXT = 0  # max_model_len when the answering worker published none


async def tokenize(request: Request) -> JSONResponse:
    generation = await read_parsed(request, tokenize_request, BodyError)
    result = await request.app.state.jobs.tokenize(request, generation)
    tokens = result.prompt_token_ids or []
    return JSONResponse({"count": len(tokens), "max_model_len": await _context_of(request, result),
                         "tokens": tokens, "token_strs": None})


async def detokenize(request: Request) -> JSONResponse:
    generation = await read_parsed(request, detokenize_request, BodyError)
    try:
        result = await request.app.state.jobs.tokenize(request, generation)
    except ApiError as exc:  # a token id outside the vocabulary, named as the body names it
        if exc.param == "prompt" or (exc.code == FAILED_CODE and exc.message.startswith("token id")):
            exc.param, exc.message = TOKEN_IDS_FIELD, f"{TOKEN_IDS_FIELD}: {exc.message.removeprefix('prompt: ')}"
        raise
    return JSONResponse({"prompt": result.text})


def tokenize_request(body: dict) -> GenerationRequest:
    """The tokenize_only job of a /tokenize body, vLLM's completion or chat form; BodyError naming the field at
    fault."""
    chat = body.get("messages") is not None
    if chat and body.get("prompt") is not None:
        raise BodyError("give prompt or messages, not both", param="prompt")
    unknown_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    body = {k: v for k, v in body.items() if v is not None}  # null means the default, as in vLLM
    for name, value in (CHAT_OPTIONS if chat else COMPLETION_OPTIONS).items():
        _check_option(body, name, value)
    request: dict[str, Any] = {"tokenize_only": True, **{k: body[k] for k in ("model",) if k in body}}
    if chat:
        request["messages"] = chat_messages(body["messages"])
        request.update({k: body[k] for k in ("tools", "chat_template_kwargs") if body.get(k) not in (None, [])})
    elif "prompt" not in body:
        raise BodyError("prompt or messages is required", param="prompt")
    else:
        request["prompt"] = body["prompt"]
    return validated(request, dotted)


def detokenize_request(body: dict) -> GenerationRequest:
    """The tokenize_only job of a /detokenize body: its token ids, whose text the worker answers."""
    unknown_fields(body, DETOKENIZE_FIELDS)
    if body.get(TOKEN_IDS_FIELD) is None:
        raise BodyError(f"{TOKEN_IDS_FIELD} is required", param=TOKEN_IDS_FIELD)
    request = {"tokenize_only": True, "prompt_token_ids": body[TOKEN_IDS_FIELD],
               **({"model": body["model"]} if body.get("model") is not None else {})}
    return validated(request, _detokenize_names)


def _detokenize_names(loc: tuple) -> str:
    name = dotted(loc)
    return TOKEN_IDS_FIELD + name[len("prompt_token_ids"):] if name.startswith("prompt_token_ids") else name


def _check_option(body: dict, name: str, rendered: bool) -> None:
    """BodyError naming an option that is not a boolean, or asks for another rendering than a generation's."""
    value = body.get(name, rendered)
    if not isinstance(value, bool):
        raise BodyError(f"{name} must be true or false", param=name)
    if value != rendered:
        raise BodyError(TOKEN_STRS_REFUSAL if name == "return_token_strs" else (
            f"{name}: only {str(rendered).lower()} is available: the prompt is rendered as a generation renders it"),
            param=name)


async def _context_of(request: Request, result: GenerationResult) -> int:
    """The max_model_len the worker that answered publishes (another live worker of its model's, if it has gone)."""
    live = await run_in_threadpool(request.app.state.jobs.live_workers)
    answering = [w for w in live if w.name == result.worker] or [w for w in live if w.model == result.model]
    return answering[0].max_model_len if answering else UNKNOWN_CONTEXT
