"""The bodies of OpenAI's two generation endpoints, chat completions and completions: each is read into a
GenerationRequest, or refused with a BodyError that names the field at fault.

The gateway (batcher/gateway) reads its HTTP request bodies with this `parse_body`, as batch lines (batch_lines.py)
read theirs, so a batch line and an HTTP request are read alike; responses/ and embeddings_body.py share its
BodyError, `validated` and `unknown_fields`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from rqbatcher.constraints import InvalidConstraint
from rqbatcher.errors import names, quoted, readable, short_name
from rqbatcher.openai.body_fields import GENERATION_KINDS, refusal
from rqbatcher.openai.logprob_objects import LogprobsError, requested
from rqbatcher.openai.service_tiers import SERVICE_TIERS
from rqbatcher.reasoning import template_variables
from rqbatcher.schema import GenerationRequest

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                   "repetition_penalty", "n", "frequency_penalty", "presence_penalty", "logit_bias")
CONSTRAINT_FIELDS = ("response_format", "regex", "choice")  # regex and choice: vLLM's extras
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # the chat endpoint's
COMPLETION_FIELDS = ("echo", "best_of")  # the completions endpoint's
# Accepted and ignored, each for a reason (docs/gateway.md lists every field's state): `stream` is the gateway's to
# read; `safety_identifier` and `prompt_cache_key` are hints for OpenAI's own abuse checks and cache routing
# (batcher's prefix cache needs none); `store` asks OpenAI to keep the completion for its dashboard, which batcher
# has no place for; `verbosity` tunes models that reason (and `reasoning_effort` on completions: the chat endpoint
# passes it to the chat template, batcher/reasoning.py); `prediction` is a latency hint (predicted output), never
# needed for a correct answer.
IGNORED_BODY_FIELDS = ("stream", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "store",
                       "reasoning_effort", "verbosity", "prediction")
# Refused with the reason: ignoring them would mislead (the answer would lack what was asked for)
REFUSED_BODY_FIELDS = {
    "audio": "audio output is not available: the models batcher serves write text",
    "web_search_options": "web_search_options: web search is not available, batcher runs the model alone",
    "suffix": "suffix (fill in the middle) is not available: the answer only continues the prompt",
    "functions": "functions is deprecated: give tools instead",
    "function_call": "function_call is deprecated: give tool_choice instead",
}
MAX_OPENAI_METADATA = 16  # OpenAI's limits on `metadata`: pairs, key and value lengths
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}  # OpenAI's -> ours
DROPPED_MESSAGE_FIELDS = ("name", "annotations", "refusal", "audio")  # a participant's name, and what a client
# copies back from an answer: no template of ours reads them
SCHEMA_NAMES = {"prompt_token_ids": "prompt"}  # the request's fields the body names otherwise


def parse_body(body: Any, url: str, extra_fields: tuple[str, ...] = ()) -> GenerationRequest:
    """The request of one OpenAI request body, a batch line's or an HTTP request's, for `url`; raise
    BodyError with a readable reason (and the field at fault, where there is one).

    `extra_fields` are fields the caller reads itself (the gateway's `stream`); any other field that
    is not ours to honour is refused rather than silently ignored. No value is coerced to another type, and the
    ranges are OpenAI's (body_fields.py)."""
    if not isinstance(body, dict):
        raise BodyError("body must be a JSON object")
    chat = url == CHAT_URL
    endpoint_fields = ("logprobs", "top_logprobs", "modalities", "chat_template_kwargs",
                       *TOOL_FIELDS) if chat else ("logprobs", *COMPLETION_FIELDS)
    known = {*SAMPLING_FIELDS, *CONSTRAINT_FIELDS, *IGNORED_BODY_FIELDS, *extra_fields, *endpoint_fields,
             "prompt", "messages", "model", "max_completion_tokens", "service_tier", "metadata", "user",
             "prompt_logprobs"}
    unknown_fields(body, known | REFUSED_BODY_FIELDS.keys())
    body = {k: v for k, v in body.items() if v is not None}  # null means the default, for every field
    if body.get("tools") == []:  # no tools, as some clients say it (vLLM reads it so too)
        del body["tools"]
    refused = sorted(set(body) & REFUSED_BODY_FIELDS.keys())
    if refused:
        raise BodyError(REFUSED_BODY_FIELDS[refused[0]], param=refused[0])
    required = "messages" if chat else "prompt"
    if required not in body:
        raise BodyError(f"{required} is required", param=required)
    bad = refusal(body, GENERATION_KINDS)
    if bad is not None:
        raise BodyError(*bad)
    if chat and body.get("modalities", ["text"]) != ["text"]:
        raise BodyError("modalities is [\"text\"]: the models batcher serves write text", param="modalities")
    request: dict[str, Any] = {"sampling": {k: body[k] for k in SAMPLING_FIELDS if k in body}}
    if "best_of" in body:
        request["sampling"]["best_of"] = body["best_of"]
    request.update({k: body[k] for k in (*TOOL_FIELDS, "echo", "user") if k in body})
    if "metadata" in body:
        request["metadata"] = openai_metadata(body["metadata"])
    if "max_completion_tokens" in body:  # the chat endpoint's newer name for max_tokens
        request["sampling"]["max_tokens"] = body["max_completion_tokens"]
    try:
        request["sampling"]["logprobs"] = requested(body, url == CHAT_URL)
    except LogprobsError as exc:
        raise BodyError(str(exc), param=exc.param) from None
    prompt_logprobs_of(body, request, chat)
    if body.get("model") is not None:
        request["model"] = body["model"]
    request.update({k: body[k] for k in CONSTRAINT_FIELDS if body.get(k) is not None})
    if body.get("service_tier") is not None:
        request["service_class"] = service_class_of(body["service_tier"])
    if url == CHAT_URL:
        request["messages"] = chat_messages(body.get("messages"))
        request["chat_template_kwargs"] = template_variables(body.get("chat_template_kwargs"),
                                                             body.get("reasoning_effort"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            request["prompt_token_ids"] = prompt
        else:
            request["prompt"] = prompt
    return validated(request, _client_names(body))


def prompt_logprobs_of(body: dict, request: dict, chat: bool) -> None:
    """The prompt's logprobs a body asks for: vLLM's `prompt_logprobs`, or a completion's `echo` with `logprobs`
    (which return them in the legacy object). `max_tokens` 0, the prompt alone, is a completion's with either."""
    if "prompt_logprobs" in body:
        request["prompt_logprobs"] = body["prompt_logprobs"]
    elif body.get("echo") and request["sampling"]["logprobs"] is not None:
        request["prompt_logprobs"] = request["sampling"]["logprobs"]
    if request["sampling"].get("max_tokens") == 0 and (chat or not (body.get("echo") or "prompt_logprobs" in body)):
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise BodyError(f"{name}: at least 1 (0, the prompt alone, goes with a completion's echo or "
                        "prompt_logprobs)", param=name)


def unknown_fields(body: dict, known: set[str]) -> None:
    """BodyError naming the body's first field outside `known`, if it has one."""
    unknown = set(body) - known
    if unknown:
        raise BodyError(f"unsupported body fields: {names(unknown)}", param=short_name(min(unknown)))


def service_class_of(tier: Any) -> str:
    """batcher's service class for OpenAI's `service_tier` (BodyError naming it for another tier)."""
    if not isinstance(tier, str) or tier not in SERVICE_TIERS:
        raise BodyError(f"service_tier is one of {', '.join(SERVICE_TIERS)}; got {quoted(tier)}",
                        param="service_tier")
    return SERVICE_TIERS[tier]


def validated(request: dict, where: Callable[[tuple], str], whole: str | None = None) -> GenerationRequest:
    """The job of a body read into `request`; BodyError with pydantic's reason, each problem named as the body names
    its field (`where` maps an error's location to that name: `max_completion_tokens`, `prompt.3`), and the field
    at fault as its param (`whole` for a fault of the request as a whole). The tools' grammar is checked whole:
    each schema was alone."""
    try:
        generation = GenerationRequest.model_validate(request)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"] if exc.errors() else ()
        param = where(loc).split(".")[0] if loc else whole
        raise BodyError(readable(exc, where), param=param or whole) from None
    if generation.calls_tools:
        try:
            generation.grammar()
        except InvalidConstraint as exc:
            raise BodyError(str(exc), param="tools") from None
    return generation


def openai_metadata(metadata: Any) -> Any:
    """OpenAI's `metadata`: up to 16 string pairs, kept with the job (BodyError naming metadata otherwise)."""
    if not isinstance(metadata, dict) or len(metadata) > MAX_OPENAI_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS
            and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items()):
        raise BodyError(f"metadata is an object of at most {MAX_OPENAI_METADATA} string pairs, keys of at most "
                        f"{MAX_METADATA_KEY_CHARS} characters and values of at most {MAX_METADATA_VALUE_CHARS}",
                        param="metadata")
    return metadata


def chat_messages(messages: Any) -> Any:
    """OpenAI's messages in batcher's form: `developer` is the system role, and a `content` list of text parts is
    their text, joined with newlines (as vLLM does). A part of another kind (an image, audio) is refused: the models
    batcher serves read text only. Nulls, an empty `tool_calls` and the fields a client copies back from an answer
    are dropped. Anything else passes through for the schema to judge."""
    if not isinstance(messages, list):
        return messages
    converted = []
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            message = {k: v for k, v in message.items() if v is not None and k not in DROPPED_MESSAGE_FIELDS}
            if isinstance(message.get("role"), str) and message["role"] in ROLES:
                message["role"] = ROLES[message["role"]]
            if isinstance(message.get("content"), list):
                message["content"] = _text_of_parts(message["content"], i)
            if message.get("tool_calls") == []:
                del message["tool_calls"]
        converted.append(message)
    return converted


def _text_of_parts(parts: list, index: int) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BodyError(f"messages[{index}].content: only text parts are read (the model takes text); got a "
                            f"part of type {quoted(kind)}", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _client_names(body: dict) -> Callable[[tuple], str]:
    """How the body names a schema location: its sampling fields by their own names (`max_completion_tokens` where it
    gave that), and `prompt` for token ids."""
    def where(loc: tuple) -> str:
        parts = [str(p) for p in loc]
        if parts[:1] == ["sampling"]:
            parts = parts[1:]
            if parts[:1] == ["max_tokens"] and "max_completion_tokens" in body:
                parts[0] = "max_completion_tokens"
        elif parts:
            parts[0] = SCHEMA_NAMES.get(parts[0], parts[0])
        return ".".join(parts)

    return where


class BodyError(ValueError):
    """A request body we cannot run; `param` names the field at fault, where there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
