"""The OpenAI batch file format: one request per line in, one response per line out.

In:  {"custom_id": ..., "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}
Out: {"custom_id": ..., "response": {"status_code": 200, "body": {...}}, "error": null}
This module reads a line's envelope and the bodies of the two generation endpoints; batch_endpoints.py adds
/v1/responses and /v1/embeddings lines.

The gateway (batcher/gateway) reads its HTTP request bodies with the same `parse_body` and answers with
the same `response_body`, so a batch line and an HTTP answer never differ in format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from rqbatcher.answer_reader import read_whole
from rqbatcher.constraints import InvalidConstraint
from rqbatcher.errors import names, quoted, readable, short_name
from rqbatcher.openai.body_fields import GENERATION_KINDS, refusal
from rqbatcher.openai.logprob_objects import (
    LogprobsError,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    prompt_logprobs_body,
    requested,
)
from rqbatcher.openai.service_tiers import SERVICE_TIERS
from rqbatcher.reasoning import template_variables
from rqbatcher.schema import ChatFormat, Choice, GenerationRequest, GenerationResult, Usage

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
GENERATION_ENDPOINTS = (COMPLETIONS_URL, CHAT_URL)
SCHEMA_NAMES = {"prompt_token_ids": "prompt"}  # the request's fields the body names otherwise
COMPLETION_ID_PREFIX = "cmpl-"  # a response's id is the prefix and the job id
CHAT_ID_PREFIX = "chatcmpl-"
# batcher's finish reasons that OpenAI names otherwise; `cancelled` never reaches a response (a cancelled
# job's batch line is an error line, and the gateway answers it with an error)
FINISH_REASONS = {"timeout": "length"}
TOOL_CALLS_FINISH = "tool_calls"  # a chat answer that ended with complete tool calls


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


def parse_batch_line(line: str, endpoint: str | None = None,
                     parse: Callable[[Any, str], GenerationRequest] = parse_body,
                     urls: tuple[str, ...] = GENERATION_ENDPOINTS) -> tuple[str | None, GenerationRequest]:
    """Parse one input line into `(custom_id, request)`; raise BatchLineError with a readable reason.

    The line's url is one of `urls`, and `parse(body, url)` makes its request (batch_endpoints.parse_line reads
    every endpoint's lines). `body.model` becomes the request's model (the job runs on a worker serving it). With
    `endpoint`, the line's url must be that one (a batch has one endpoint). The custom_id is returned on the
    exception as `exc.custom_id` when it could be read."""
    custom_id = None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BatchLineError(None, f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise BatchLineError(None, "each line must be a JSON object")
    custom_id = obj.get("custom_id")
    if custom_id is not None and not isinstance(custom_id, str):
        raise BatchLineError(None, "custom_id must be a string")
    url = obj.get("url")
    if obj.get("method", "POST") != "POST":
        raise BatchLineError(custom_id, "method must be POST")
    if url not in urls:
        raise BatchLineError(custom_id, f"url must be one of {', '.join(urls)}, got {quoted(url)}")
    if endpoint is not None and url != endpoint:
        raise BatchLineError(custom_id, f"url must be the batch's endpoint {endpoint}, got {url}")
    try:
        return custom_id, parse(obj.get("body"), url)
    except BodyError as exc:
        raise BatchLineError(custom_id, str(exc)) from None


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


class BatchLineError(ValueError):
    def __init__(self, custom_id: str | None, message: str) -> None:
        super().__init__(message)
        self.custom_id = custom_id


def openai_finish_reason(reason: str) -> str:
    """OpenAI's name for a finish reason: a running timeout cuts the text short as a token limit does."""
    return FINISH_REASONS.get(reason, reason)


def usage_body(usage: Usage) -> dict:
    """OpenAI's usage object; the prompt tokens found in the worker's prefix cache are its `cached_tokens`."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def response_body(result: GenerationResult, endpoint: str = COMPLETIONS_URL, request_id: str | None = None,
                  created: int | None = None, service_tier: str | None = None,
                  request: GenerationRequest | None = None) -> dict:
    """The endpoint's OpenAI object (text_completion or chat.completion) for a result: the body of a batch
    output line and the answer of the gateway's HTTP endpoints. `service_tier` is the tier it ran in; `request`
    (what the job carried) says whether the answer is read for tool calls, and whether it echoes the prompt.

    `token_ids` is our addition to a completion choice; OpenAI clients ignore unknown fields."""
    usage = usage_body(result.usage)
    choices = result.choices or [Choice(index=0, text=result.text, token_ids=result.token_ids,
                                        finish_reason=result.finish_reason, logprobs=result.logprobs)]
    if endpoint == CHAT_URL:
        shaped = [_chat_choice(c, request_id or "", request, result.chat_format) for c in choices]
        body = {"id": f"{CHAT_ID_PREFIX}{request_id}", "object": "chat.completion"}
    else:
        echoed = request.prompt if request is not None and request.echo else ""
        shaped = [{"index": c.index, "text": echoed + c.text, "token_ids": c.token_ids,
                   "logprobs": _completion_logprobs(c, result, echoed), "finish_reason":
                   openai_finish_reason(c.finish_reason)} for c in choices]
        vllm_field = request is not None and request.prompt_logprobs is not None and not echoed_with_logprobs(request)
        for choice in shaped if vllm_field else ():  # an echo with logprobs has them in the legacy object
            choice["prompt_logprobs"] = prompt_logprobs_of_result(result, request)
        body = {"id": f"{COMPLETION_ID_PREFIX}{request_id}", "object": "text_completion"}
    if endpoint == CHAT_URL and request is not None and request.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_of_result(result, request)  # vLLM's place on chat
    body.update(created=created, model=result.model, choices=shaped, usage=usage)
    if service_tier is not None:
        body["service_tier"] = service_tier
    return body


def _chat_choice(choice: Choice, request_id: str, request: GenerationRequest | None,
                 chat_format: ChatFormat | None) -> dict:
    """A chat choice: its reasoning apart (as `reasoning_content`, and vLLM's newer `reasoning`), then its text as
    content, or the tool calls it made in the model's format (finish_reason `tool_calls`)."""
    reasoning, content, calls = read_whole(choice.text, request_id, choice.index, request, chat_format)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = reasoning
    finish_reason = openai_finish_reason(choice.finish_reason)
    if calls:
        message["tool_calls"] = [call.to_dict() for call in calls]
        finish_reason = TOOL_CALLS_FINISH if finish_reason == "stop" else finish_reason
    return {"index": choice.index, "message": message, "logprobs": chat_logprobs(choice.logprobs),
            "finish_reason": finish_reason}


def echoed_with_logprobs(request: GenerationRequest) -> bool:
    return request.echo and request.sampling.logprobs is not None


def _completion_logprobs(choice: Choice, result: GenerationResult, echoed: str) -> dict | None:
    """A completion choice's legacy logprobs: with echo, the prompt's tokens first."""
    if echoed and choice.logprobs is not None and result.prompt_logprobs is not None:
        return echoed_logprobs(echoed, result.prompt_logprobs, choice.logprobs)
    return completion_logprobs(choice.logprobs)


def prompt_logprobs_of_result(result: GenerationResult, request: GenerationRequest) -> list | None:
    """vLLM's `prompt_logprobs` of a result (None from a worker that did not compute them)."""
    if result.prompt_logprobs is None or result.prompt_token_ids is None:
        return None
    return prompt_logprobs_body(result.prompt_logprobs, result.prompt_token_ids, request.prompt_logprobs)


def success_line(custom_id: str | None, body: dict, request_id: str | None = None) -> dict:
    """An output line around an endpoint's answer `body` (status 200)."""
    line = {"custom_id": custom_id, "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None}
    return {"id": f"batch_req_{request_id}", **line} if request_id is not None else line


def error_line(custom_id: str | None, message: str, code: str = "invalid_request",
               request_id: str | None = None) -> dict:
    line = {"custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
    return {"id": f"batch_req_{request_id}", **line} if request_id is not None else line
