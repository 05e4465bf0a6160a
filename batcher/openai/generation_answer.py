"""The answer of OpenAI's two generation endpoints: the text_completion or chat.completion object of a result,
with its usage and finish reasons.

A batch output line's body and the gateway's HTTP answer are both built by `response_body` (and the gateway's
streamed chunks take the same ids, usage and finish reasons), so a batch line and an HTTP answer never differ.
"""

from __future__ import annotations

from typing import Any

from rqbatcher.answer_reader import read_whole
from rqbatcher.openai.generation_body import CHAT_URL, COMPLETIONS_URL
from rqbatcher.openai.logprob_objects import chat_logprobs, completion_logprobs, echoed_logprobs, prompt_logprobs_body
from rqbatcher.schema import ChatFormat, Choice, GenerationRequest, GenerationResult, Usage

COMPLETION_ID_PREFIX = "cmpl-"  # a response's id is the prefix and the job id
CHAT_ID_PREFIX = "chatcmpl-"
# batcher's finish reasons that OpenAI names otherwise; `cancelled` never reaches a response (a cancelled
# job's batch line is an error line, and the gateway answers it with an error)
FINISH_REASONS = {"timeout": "length"}
TOOL_CALLS_FINISH = "tool_calls"  # a chat answer that ended with complete tool calls


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

    `token_ids` is our addition to a completion choice, and vLLM's `stop_reason` (the stop string that ended it, or
    None) to every choice; OpenAI clients ignore unknown fields."""
    usage = usage_body(result.usage)
    choices = result.choices or [Choice(index=0, text=result.text, token_ids=result.token_ids,
                                        finish_reason=result.finish_reason, stop_sequence=result.stop_sequence,
                                        logprobs=result.logprobs)]
    if endpoint == CHAT_URL:
        shaped = [_chat_choice(c, request_id or "", request, result.chat_format) for c in choices]
        body = {"id": f"{CHAT_ID_PREFIX}{request_id}", "object": "chat.completion"}
    else:
        echoed = request.prompt if request is not None and request.echo else ""
        shaped = [{"index": c.index, "text": echoed + c.text, "token_ids": c.token_ids,
                   "logprobs": _completion_logprobs(c, result, echoed), "finish_reason":
                   openai_finish_reason(c.finish_reason), "stop_reason": c.stop_sequence} for c in choices]
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
            "finish_reason": finish_reason, "stop_reason": choice.stop_sequence}


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
