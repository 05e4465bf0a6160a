"""A result as Anthropic's Message: a thinking block, a text block and tool_use blocks, its stop reason and usage.

A model that reasons (the worker's ChatFormat names its markers) has its reasoning split off first
(batcher/reasoning.py) into a thinking block, whose signature is empty: batcher signs nothing, and drops thinking
blocks sent back. The rest is read for calls as the chat endpoint reads it (batcher/tools/calls.py), and a call's id
becomes a tool_use id (`toolu_` and the same digest), so a streamed answer and a whole one give the same ids.
batcher's finish reasons in Anthropic's words: `stop` is end_turn (tool_use when the answer made calls), or
stop_sequence with the one that matched (the worker reports it), a token limit or a running timeout is max_tokens.
Usage: Anthropic's input_tokens leaves
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
END_TURN, TOOL_USE, MAX_TOKENS, STOP_SEQUENCE = "end_turn", "tool_use", "max_tokens", "stop_sequence"
STOP_REASONS = {"stop": END_TURN, "length": MAX_TOKENS, "timeout": MAX_TOKENS}


def message_id(job_id: str) -> str:
    return MESSAGE_ID_PREFIX + job_id


def tool_use_id(call_id: str) -> str:
    return TOOL_USE_ID_PREFIX + call_id.removeprefix(CALL_ID_PREFIX)


def stop_fields(finish_reason: str, stop_sequence: str | None, made_calls: bool) -> dict:
    """A message's `stop_reason` and `stop_sequence`."""
    reason = STOP_REASONS.get(finish_reason, END_TURN)
    if reason == END_TURN and stop_sequence is not None:
        return {"stop_reason": STOP_SEQUENCE, "stop_sequence": stop_sequence}
    return {"stop_reason": TOOL_USE if made_calls and reason == END_TURN else reason, "stop_sequence": None}


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
            **stop_fields(result.finish_reason, result.stop_sequence, bool(calls)), "usage": usage_object(result.usage)}
