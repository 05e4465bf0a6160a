"""A result as Anthropic's Message: a thinking block, a text block and tool_use blocks, its stop reason and usage.

A model that reasons (the worker's ChatFormat names its markers) has its reasoning split off first
(batcher/reasoning.py) into a thinking block, whose signature is empty: batcher signs nothing, and drops thinking
blocks sent back. The rest is read for calls as the chat endpoint reads it (batcher/tools/calls.py), and a call's id
becomes a tool_use id (`toolu_` and the same digest), so a streamed answer and a whole one give the same ids.
batcher's finish reasons in Anthropic's words: `stop` is end_turn (tool_use when the answer made calls), a token
limit or a running timeout is max_tokens. A stop sequence ends the answer as Anthropic's does, but the worker does not
report which one matched, so the answer says end_turn with no stop_sequence. Usage: Anthropic's input_tokens leaves
out the prompt tokens read from the cache (cache_read_input_tokens): the worker's prefix cache hits.
"""

from __future__ import annotations

import json

from rqbatcher.answer_reader import read_whole
from rqbatcher.schema import GenerationRequest, GenerationResult, Usage
from rqbatcher.tools.calls import CALL_ID_PREFIX, Call

MESSAGE_ID_PREFIX = "msg_"
TOOL_USE_ID_PREFIX = "toolu_"
NO_SIGNATURE = ""  # a thinking block's signature: batcher signs nothing
END_TURN, TOOL_USE, MAX_TOKENS = "end_turn", "tool_use", "max_tokens"
STOP_REASONS = {"stop": END_TURN, "length": MAX_TOKENS, "timeout": MAX_TOKENS}


def message_id(job_id: str) -> str:
    return MESSAGE_ID_PREFIX + job_id


def tool_use_id(call_id: str) -> str:
    return TOOL_USE_ID_PREFIX + call_id.removeprefix(CALL_ID_PREFIX)


def stop_reason(finish_reason: str, made_calls: bool) -> str:
    reason = STOP_REASONS.get(finish_reason, END_TURN)
    return TOOL_USE if made_calls and reason == END_TURN else reason


def usage_object(usage: Usage | None) -> dict:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def thinking_block(reasoning: str) -> dict:
    return {"type": "thinking", "thinking": reasoning, "signature": NO_SIGNATURE}


def tool_use_block(call: Call) -> dict:
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": json.loads(call.arguments)}


def message_object(result: GenerationResult, job_id: str, model: str, request: GenerationRequest) -> dict:
    """The Message answering a whole result of `request`."""
    reasoning, text, calls = read_whole(result.text, job_id, 0, request, result.chat_format)
    content = [] if reasoning is None else [thinking_block(reasoning)]
    content += [{"type": "text", "text": text}] if text else []
    content += [tool_use_block(call) for call in calls]
    return {"id": message_id(job_id), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(result.finish_reason, bool(calls)), "stop_sequence": None,
            "usage": usage_object(result.usage)}
