"""OpenAI's Responses API: a request body in, a response object out, for the gateway's /v1/responses and for batch
lines of that endpoint.

Every field of the reference is in one of three states, as for chat (docs/gateway.md lists them): honoured,
accepted and ignored (the reason is given where the tuple is defined), or refused with a 400 naming it where
ignoring it would mislead. `null` means the default; an unknown field is refused.
`previous_response_id`, `background` and `stream` are the route's to act on (it prepends the stored
conversation, through `conversation`); a batch line refuses them.
"""

from __future__ import annotations

from typing import Any

from rqbatcher.errors import quoted
from rqbatcher.openai.body_fields import RESPONSES_KINDS, refusal
from rqbatcher.openai.generation_body import BodyError, openai_metadata, service_class_of, unknown_fields, validated
from rqbatcher.openai.responses.response_items import (
    INCOMPLETE_FINISHES,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
    output_items,
    text_echo,
    tool_choice_echo,
    tools_echo,
)
from rqbatcher.openai.service_tiers import TIER_OF_CLASS
from rqbatcher.reasoning import EFFORT, template_variables
from rqbatcher.schema import ChatMessage, GenerationRequest, GenerationResult, Usage
from rqbatcher.service_class import class_of

RESPONSES_URL = "/v1/responses"
RESPONSE_ID_PREFIX = "resp_"  # a response's id is the prefix and its job's id
HONOURED_FIELDS = ("input", "instructions", "model", "max_output_tokens", "temperature", "top_p", "text", "tools",
                   "tool_choice", "parallel_tool_calls", "metadata", "user", "service_tier", "store", "include",
                   "reasoning")  # reasoning.effort goes to the chat template (batcher/reasoning.py); summary is ignored
SERVER_FIELDS = ("previous_response_id", "background", "stream")  # acted on by the gateway; refused in a batch line
# Accepted and ignored, each for a reason: `top_logprobs` tunes what batcher does not return (logprobs come only
# with include's message.output_text.logprobs, which is refused);
# `truncation` only matters for an input past the model's context, which fails with its reason either way;
# `prompt_cache_*` and `safety_identifier` are hints for OpenAI's cache routing and abuse checks (the prefix cache
# needs none); `max_tool_calls` bounds built-in tools, which batcher has none of; `stream_options` holds only
# include_obfuscation (no padding is sent); `access_programs` are OpenAI account programs.
IGNORED_FIELDS = ("top_logprobs", "truncation", "prompt_cache_key", "prompt_cache_retention",
                  "prompt_cache_options", "safety_identifier", "max_tool_calls", "stream_options", "access_programs")
REFUSED_FIELDS = {
    "conversation": "conversation objects are not available: continue with previous_response_id",
    "prompt": "stored prompt templates are not available: give input and instructions",
    "context_management": "context_management (compaction) is not available",
    "moderation": "moderation is not available: batcher runs the model alone",
    "image": "image settings are not available: the models batcher serves write text",
    "background_options": "background_options are not available",
}
REFUSED_INCLUDES = {"message.output_text.logprobs": "logprobs are not returned by /v1/responses"}
SAMPLING_PARAMS = {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p"}
# The body's name of a field of the request (the messages are the instructions, a previous response's turns and the
# input, so an index into them is not one into `input`)
BODY_NAMES = {"messages": "input", "response_format": "text.format",
              **{ours: theirs for theirs, ours in SAMPLING_PARAMS.items()}}


def parse_responses_body(body: Any, extra_fields: tuple[str, ...] = (), *, batch_line: bool = False,
                         conversation: list[ChatMessage] = ()) -> GenerationRequest:
    """The request of a Responses body; raise BodyError naming the field at fault.

    `conversation` (a stored response's input and output, for previous_response_id) goes between the
    instructions and the input. `batch_line` refuses the fields only an HTTP request can act on."""
    if not isinstance(body, dict):
        raise BodyError("body must be a JSON object")
    unknown_fields(body, {*HONOURED_FIELDS, *SERVER_FIELDS, *IGNORED_FIELDS, *REFUSED_FIELDS, *extra_fields})
    body = {k: v for k, v in body.items() if v is not None}  # null means the default, for every field
    refused = sorted(set(body) & REFUSED_FIELDS.keys())
    if refused:
        raise BodyError(REFUSED_FIELDS[refused[0]], param=refused[0])
    if batch_line:
        server = [name for name in SERVER_FIELDS if name in body and body[name] is not False]
        if server:
            raise BodyError(f"{server[0]} is not available in a batch line", param=server[0])
    _check_flags(body)
    if "input" not in body and "instructions" not in body and not conversation:
        raise BodyError("input is required: there is nothing to answer", param="input")
    if body.get("tools") == []:
        del body["tools"]
    messages: list[Any] = [] if body.get("instructions") is None else [{"role": "system",
                                                                        "content": body["instructions"]}]
    messages += [m.model_dump(exclude_none=True) for m in conversation]
    if "input" in body:
        messages += input_messages(body["input"])
    request: dict[str, Any] = {"messages": messages or None,
                               "sampling": {ours: body[theirs] for theirs, ours in SAMPLING_PARAMS.items()
                                            if theirs in body}}
    if "tools" in body:
        request["tools"] = chat_tools(body["tools"])
    if "tool_choice" in body:
        request["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if "text" in body:
        request["response_format"] = chat_response_format(body["text"])
    request.update({k: body[k] for k in ("parallel_tool_calls", "user", "model") if k in body})
    request["chat_template_kwargs"] = template_variables(None, body.get("reasoning", {}).get("effort"))
    if "metadata" in body:
        request["metadata"] = openai_metadata(body["metadata"])
    if "service_tier" in body:
        request["service_class"] = service_class_of(body["service_tier"])
    return validated(request, _body_name, whole="input")  # the request as a whole: no input, or one too large


def previous_response_of(body: dict) -> str | None:
    """The id of the response the body continues (None: none); BodyError unless it is a string."""
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise BodyError(f"previous_response_id is a string; got {quoted(previous)}", param="previous_response_id")
    return previous


def _check_flags(body: dict) -> None:
    bad = refusal(body, RESPONSES_KINDS)
    if bad is not None:
        raise BodyError(*bad)
    if body.get("max_output_tokens") == 0:  # the prompt alone is a completion's (echo), not a response's
        raise BodyError("max_output_tokens must be at least 1", param="max_output_tokens")
    if body.get("background") and body.get("store") is False:
        raise BodyError("a background response is stored: background needs store true", param="background")
    refused = [i for i in body.get("include", ()) if i in REFUSED_INCLUDES]
    if refused:
        raise BodyError(f"include {refused[0]}: {REFUSED_INCLUDES[refused[0]]}", param="include")


def _body_name(loc: tuple) -> str:
    """How the body names a schema location: `max_output_tokens` for sampling.max_tokens, `input` for any message,
    and a function tool's fields flat (`tools.0.name`), as Responses writes them."""
    parts = [str(p) for p in loc if p not in ("sampling", "function", "json_schema")]
    if not parts:
        return ""
    head = BODY_NAMES.get(parts[0], parts[0])
    return head if head == "input" else ".".join((head, *parts[1:]))


def echo_fields(body: dict) -> dict:
    """What a response object echoes from its body that the GenerationRequest does not carry."""
    return {"instructions": body.get("instructions"), "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store") is not False, "background": bool(body.get("background"))}


def finished_status(result: GenerationResult) -> str:
    """A finished job's response status: incomplete when a limit the request set cut it short."""
    return "incomplete" if result.finish_reason in INCOMPLETE_FINISHES else "completed"


def response_usage(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def response_object(request: GenerationRequest, result: GenerationResult | None, *, response_id: str,
                    created_at: int, status: str, error: dict | None = None, **echo) -> dict:
    """OpenAI's response object for a request and, once its job has finished, its result. `echo` holds the fields
    the request does not carry (`echo_fields`: instructions, previous_response_id, store, background) and may
    override any other (the model that ran it, say)."""
    job_id = response_id.removeprefix(RESPONSE_ID_PREFIX)
    incomplete = status == "incomplete"
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": None, "max_output_tokens": request.sampling.max_tokens,
        "model": (result.model if result is not None and result.model else request.model) or "",
        "output": [] if result is None else output_items(request, result, job_id),
        "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
        "reasoning": {"effort": request.chat_template_kwargs.get(EFFORT), "summary": None},
        "temperature": request.sampling.temperature, "top_p": request.sampling.top_p, "text": text_echo(request),
        "tool_choice": tool_choice_echo(request), "tools": tools_echo(request),
        "truncation": "disabled", "metadata": dict(request.metadata), "user": request.user,
        "service_tier": TIER_OF_CLASS[class_of(request)], "store": True, "background": False,
        "usage": None if result is None else response_usage(result.usage), **echo}
