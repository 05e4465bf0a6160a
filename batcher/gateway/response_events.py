"""A response's stream events (OpenAI's Responses streaming), built from its job's stream events alone.

The events and their sequence numbers are a function of the job's stream as it is read from the start (by the
rule every reader follows, batcher/jobs/stream.py): replaying the stream from the start gives the same events
with the same numbers, so a client resumes with `starting_after` after a lost connection or a gateway restart,
and a job that a worker crash reran continues its text without a gap or a repeat (TextRelay holds back the
tokens a rare `restart` generates again).

Order: response.created, (a background response: response.queued, and response.in_progress once a worker
starts it) response.in_progress, then per output item output_item.added, its content_part.added and
output_text.delta events (or function_call_arguments.delta events, or a reasoning item's reasoning_text.delta
events: a thinking model's reasoning is the first item), their .done events and output_item.done;
last response.completed, response.incomplete (cut short by max_output_tokens), or response.failed (a failed job,
or a cancelled one: its status is `cancelled`).
"""

from __future__ import annotations

import json

from rqbatcher.answer_reader import AnswerReader
from rqbatcher.gateway.job_streams import AttemptDiverged, TextRelay
from rqbatcher.openai.responses.response_items import (
    INCOMPLETE_FINISHES,
    call_item,
    call_item_id,
    message_item,
    message_item_id,
    reasoning_item,
    reasoning_item_id,
    reasoning_part,
    text_part,
)
from rqbatcher.openai.responses.responses_body import RESPONSE_ID_PREFIX, finished_status, response_object
from rqbatcher.schema import ChatFormat, GenerationRequest, GenerationResult, StreamEvent, Usage
from rqbatcher.tools.calls import CallDelta

REASONING_PLACE = {"output_index": 0, "content_index": 0}  # the reasoning item, when there is one, comes first


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class ResponseEvents:
    """Fed a job's stream events in order; returns the response's events for each, numbered from 0."""

    def __init__(self, request: GenerationRequest, *, response_id: str, created_at: int, **echo) -> None:
        self.request, self.response_id, self.created_at, self.echo = request, response_id, created_at, echo
        self.job_id = response_id.removeprefix(RESPONSE_ID_PREFIX)
        self.background = bool(echo.get("background"))
        self.sequence = 0
        self.ended = False
        self._started = False
        self._relay = TextRelay()
        self._reader = AnswerReader(self.job_id, 0, request)
        self._chat_format: ChatFormat | None = None  # named by the job's `start`
        self._reasoning: str | None = None  # the reasoning so far, while its item is open
        self._first = 0  # the output index of the answer's first item: 1 after a reasoning item
        self._text: str | None = None  # the message's text so far, once its item is open
        self._call: dict | None = None  # the open call: its id, name, arguments and output index

    def opening(self) -> list[dict]:
        events = [self._event("response.created", response=self._response("queued" if self.background
                                                                          else "in_progress"))]
        if self.background:
            return events + [self._event("response.queued", response=self._response("queued"))]
        self._started = True
        return events + [self._event("response.in_progress", response=self._response("in_progress"))]

    def feed(self, event: StreamEvent) -> list[dict]:
        if self.ended:
            return []
        if event.type == "start":
            if event.chat_format is not None and self._chat_format is None:
                self._chat_format = event.chat_format
                self._reader.read_as(event.chat_format)
            if self._started:
                return []
            self._started = True
            return [self._event("response.in_progress", response=self._response("in_progress"))]
        if event.type == "restart":
            self._relay.restart()
            return []
        if event.type == "error":
            return self._fail("failed", {"code": "server_error", "message": event.error or "the request failed"})
        try:
            if event.type == "token" and event.choice == 0:
                reasoning, content, calls = self._reader.feed(self._relay.delta(event))
                return self._reasoning_piece(reasoning) + self._pieces(content, calls)
            if event.type == "done":
                self._relay.check_end()
                return self._done(event)
        except AttemptDiverged as exc:
            return self._fail("failed", {"code": "server_error", "message": str(exc)})
        return []

    # ----- the output items -----
    def _reasoning_piece(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = []
        if self._reasoning is None:
            self._reasoning, self._first = "", 1
            item = {**reasoning_item(self.job_id, "", "in_progress"), "content": []}
            events.append(self._event("response.output_item.added", output_index=0, item=item))
        self._reasoning += delta
        return events + [self._event("response.reasoning_text.delta", item_id=reasoning_item_id(self.job_id),
                                     **REASONING_PLACE, delta=delta)]

    def _close_reasoning(self, status: str) -> list[dict]:
        if self._reasoning is None:
            return []
        text, self._reasoning = self._reasoning, None
        return [self._event("response.reasoning_text.done", item_id=reasoning_item_id(self.job_id),
                            **REASONING_PLACE, text=text),
                self._event("response.output_item.done", output_index=0,
                            item={**reasoning_item(self.job_id, text, status), "content": [reasoning_part(text)]})]

    def _pieces(self, content: str, calls: list[CallDelta]) -> list[dict]:
        events = self._close_reasoning("completed") if content or calls else []
        if content:
            if self._text is None:
                events += self._open_message()
            self._text += content
            events.append(self._event("response.output_text.delta", **self._text_place(), delta=content,
                                      logprobs=[]))
        for piece in calls:
            if piece.id is not None:
                events += self._close_call("completed")
                self._call = {"id": piece.id, "name": piece.name, "arguments": "",
                              "output_index": self._first + piece.index}
                events.append(self._event("response.output_item.added", output_index=self._call["output_index"],
                                          item=call_item(piece.id, piece.name, "", "in_progress")))
            if piece.arguments:
                self._call["arguments"] += piece.arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=call_item_id(self._call["id"]),
                                          output_index=self._call["output_index"], delta=piece.arguments))
        return events

    def _open_message(self) -> list[dict]:
        self._text = ""
        item = {**message_item(self.job_id, "", "in_progress"), "content": []}
        return [self._event("response.output_item.added", output_index=self._first, item=item),
                self._event("response.content_part.added", **self._text_place(), part=text_part(""))]

    def _text_place(self) -> dict:
        return {"item_id": message_item_id(self.job_id), "output_index": self._first, "content_index": 0}

    def _close_message(self, status: str) -> list[dict]:
        if self._text is None:
            return []
        text, self._text = self._text, None
        return [self._event("response.output_text.done", **self._text_place(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._text_place(), part=text_part(text)),
                self._event("response.output_item.done", output_index=self._first,
                            item=message_item(self.job_id, text, status))]

    def _close_call(self, status: str) -> list[dict]:
        if self._call is None:
            return []
        call, self._call = self._call, None
        item = call_item(call["id"], call["name"], call["arguments"], status)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], name=call["name"],
                            output_index=call["output_index"], arguments=call["arguments"]),
                self._event("response.output_item.done", output_index=call["output_index"], item=item)]

    # ----- the end -----
    def _done(self, event: StreamEvent) -> list[dict]:
        if event.finish_reason == "cancelled":
            return self._fail("cancelled", None)  # its status says why; OpenAI sets no error
        reasoning, content, calls = self._reader.finish()
        events = self._reasoning_piece(reasoning) + self._pieces(content, calls)
        status = "incomplete" if event.finish_reason in INCOMPLETE_FINISHES else "completed"
        events += self._close_reasoning(status)  # an answer cut short inside its reasoning
        if not self._reader.made_calls and self._text is None:
            events += self._open_message()  # an empty answer is still one message
        events += self._close_message(status) + self._close_call(status)
        usage = event.usage or Usage(prompt_tokens=0, completion_tokens=len(self._relay.token_ids))
        result = GenerationResult(text=self._relay.text, token_ids=self._relay.token_ids,
                                  finish_reason=event.finish_reason or "stop", usage=usage,
                                  chat_format=self._chat_format)
        status = finished_status(result)
        self.ended = True
        return events + [self._event(f"response.{status}", response=self._response(status, result))]

    def _fail(self, status: str, error: dict | None) -> list[dict]:
        self.ended = True
        return [self._event("response.failed", response=self._response(status, error=error))]

    def _response(self, status: str, result: GenerationResult | None = None, error: dict | None = None) -> dict:
        return response_object(self.request, result, response_id=self.response_id, created_at=self.created_at,
                               status=status, error=error, **self.echo)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event
