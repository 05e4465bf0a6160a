"""A job's stream as Anthropic's server-sent events: message_start, then each content block (content_block_start,
its deltas, content_block_stop), message_delta with the stop reason and the usage, and message_stop.

message_start waits for the job's first tokens, whose event carries the prompt's usage (input_tokens), so a request
that fails before it answers with an `error` event alone. The job's `start` event names how its model writes
(`read_as`): a model that reasons streams its reasoning as a thinking block (thinking_delta) first. Then text arrives
as text_delta events of a text block; an answer that is calls (batcher/tools/calls.py reads them as they stream)
gives a tool_use block per call, its arguments as input_json_delta pieces.
"""

from __future__ import annotations

from rqbatcher.answer_reader import AnswerReader
from rqbatcher.anthropic_messages.anthropic_errors import sse
from rqbatcher.anthropic_messages.message_object import (
    message_id,
    stop_fields,
    thinking_block,
    tool_use_id,
    usage_object,
)
from rqbatcher.schema import ChatFormat, GenerationRequest, Usage
from rqbatcher.tools.calls import CallDelta

THINKING, TEXT, TOOL_USE = "thinking", "text", "tool_use"
PING = sse("ping", {"type": "ping"})


class MessageEvents:
    """The events of one streamed message, made from the text of its job's single answer."""

    def __init__(self, job_id: str, model: str, request: GenerationRequest) -> None:
        self.job_id, self.model = job_id, model
        self.reader = AnswerReader(job_id, 0, request)
        self.started = False
        self.index = -1  # of the open content block, or the last one closed
        self.open: str | None = None  # the open block's type

    def read_as(self, chat_format: ChatFormat) -> None:
        """Read the answer as the model writes it (a rerun's `start` names the same format: reading goes on)."""
        self.reader.read_as(chat_format)

    def start(self, usage: Usage | None) -> list[bytes]:
        """message_start with the prompt's usage, and a ping, as Anthropic sends them."""
        self.started = True
        message = {"id": message_id(self.job_id), "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {**usage_object(usage), "output_tokens": 0}}
        return [sse("message_start", {"type": "message_start", "message": message}), PING]

    def text(self, delta: str) -> list[bytes]:
        """The events of new answer text (none while it may still open a marker or a call)."""
        reasoning, content, calls = self.reader.feed(delta)
        return self._thinking(reasoning) + self._blocks(content, calls)

    def finish(self, finish_reason: str, stop_sequence: str | None, usage: Usage | None) -> list[bytes]:
        """What was held back, the last block's end, message_delta and message_stop."""
        reasoning, content, calls = self.reader.finish()
        events = self._thinking(reasoning) + self._blocks(content, calls) + self._close()
        delta = stop_fields(finish_reason, stop_sequence, self.reader.made_calls)
        events.append(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_object(usage)}))
        return [*events, sse("message_stop", {"type": "message_stop"})]

    def _thinking(self, reasoning: str) -> list[bytes]:
        if not reasoning:
            return []
        events = self._open(thinking_block("")) if self.open != THINKING else []
        return [*events, self._delta({"type": "thinking_delta", "thinking": reasoning})]

    def _blocks(self, content: str, calls: list[CallDelta]) -> list[bytes]:
        events = []
        if content:
            if self.open != TEXT:
                events += self._open({"type": TEXT, "text": ""})
            events.append(self._delta({"type": "text_delta", "text": content}))
        for call in calls:
            if call.id is not None:
                events += self._open({"type": TOOL_USE, "id": tool_use_id(call.id), "name": call.name, "input": {}})
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def _open(self, block: dict) -> list[bytes]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        return [*events, sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
