"""/v1/completions and /v1/chat/completions: one job per request, answered when it ends, or streamed.

The body is read by the batch lines' parser (`rqbatcher.openai.generation_body.parse_body`) and answered with their
`generation_answer.response_body`, so an HTTP answer and a batch output line never differ. The job service
(job_service.py) checks the model (404 `model_not_found` at once unless a live worker of the gateway's queue serves
it, rather than a request that hangs until some worker appears; a body without a model runs on any worker of the
queue), enqueues the job and waits for its end, whose `done` event carries the answer.

With `stream: true` the job's Redis stream is relayed as server-sent events in OpenAI's chunk format,
ending with `data: [DONE]`; a failure is sent as an `{"error": ...}` event, which the official SDKs raise.
A client that goes away before its job ends, streaming or waiting, cancels the job.

Finish reasons: stop and length are OpenAI's; a running timeout answers `length` (its text was cut short
by a limit the request set); a job cancelled by someone else answers an error, and so does a failed job:
400, because the reasons a worker refuses a request (a prompt longer than the model's context, a
chat request to a model without a chat template) are the request's, and the SDKs would retry a 5xx.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from rqbatcher.answer_reader import AnswerReader
from rqbatcher.gateway import job_streams
from rqbatcher.gateway.body import read_json
from rqbatcher.gateway.error_objects import SERVER_ERROR, ApiError, error_body
from rqbatcher.gateway.job_service import CANCELLED_MESSAGE, JobService
from rqbatcher.openai.generation_answer import (
    CHAT_ID_PREFIX,
    COMPLETION_ID_PREFIX,
    TOOL_CALLS_FINISH,
    openai_finish_reason,
    response_body,
    usage_body,
)
from rqbatcher.openai.generation_body import CHAT_URL, COMPLETIONS_URL, BodyError, parse_body
from rqbatcher.openai.logprob_objects import chat_logprobs, completion_logprobs, echoed_logprobs
from rqbatcher.openai.service_tiers import TIER_OF_CLASS
from rqbatcher.schema import ChatFormat, GenerationRequest, StreamEvent, TokenLogprob, Usage
from rqbatcher.service_class import class_of
from rqbatcher.tools.calls import CallDelta

DONE = b"data: [DONE]\n\n"


async def completions(request: Request):
    return await _complete(request, COMPLETIONS_URL)


async def chat_completions(request: Request):
    return await _complete(request, CHAT_URL)


async def _complete(request: Request, url: str):
    app = request.app
    body = await read_json(request, app.state.config.max_request_bytes)
    stream = False if body.get("stream") is None else body["stream"]  # null means the default
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    usage_options = _usage_options(body.get("stream_options"), stream)
    try:
        generation = parse_body(body, url, extra_fields=("stream_options",))
    except BodyError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    if stream and (generation.sampling.best_of or 1) > generation.sampling.n:
        raise ApiError(400, "best_of above n cannot be streamed: the best answers are known only at the end",
                       param="best_of")
    if stream and "prompt_logprobs" in body:  # (echo with logprobs streams the prompt's, in the legacy object)
        raise ApiError(400, "prompt_logprobs is not streamed: ask without stream", param="prompt_logprobs")
    tier = TIER_OF_CLASS[class_of(generation)]  # echoed, as OpenAI does
    model, job_id = await run_in_threadpool(app.state.jobs.submit, generation, request.state)
    created = int(time.time())
    if stream:
        chunks = Chunks(url, job_id, created, model, usage_options, tier, generation)
        return EventStreamResponse(_relay(request, job_id, chunks))
    result = await app.state.jobs.result_when_ended(request, job_id)
    return JSONResponse(response_body(result, url, request_id=job_id, created=created, service_tier=tier,
                                      request=generation))


# include_obfuscation is accepted and ignored (no padding is sent); continuous_usage_stats is vLLM's: usage in every
# chunk, which load generators such as guidellm read
STREAM_OPTIONS = ("include_usage", "include_obfuscation", "continuous_usage_stats")


@dataclass(frozen=True)
class UsageOptions:
    final: bool = False  # a last chunk with the whole usage (include_usage)
    continuous: bool = False  # every chunk with the usage so far (continuous_usage_stats)


def _usage_options(options, stream: bool) -> UsageOptions:
    if options is None:
        return UsageOptions()
    if not stream or not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS) or any(
            v is not None and not isinstance(v, bool) for v in options.values()):
        raise ApiError(400, "stream_options takes include_usage, include_obfuscation and continuous_usage_stats, "
                       "each true or false, with stream: true", param="stream_options")
    continuous = bool(options.get("continuous_usage_stats"))
    return UsageOptions(final=bool(options.get("include_usage")) or continuous, continuous=continuous)


# ----- streaming -----
class Chunks:
    """Server-sent events in OpenAI's chunk format (chat.completion.chunk, or text_completion). A chat answer's
    reasoning is split off first (batcher/reasoning.py, once the `start` event names the model's format: `read_as`)
    and sent as `reasoning_content` and `reasoning` deltas; the rest of an answer to a request with tools is read for
    calls (batcher/tools/calls.py) and sent as `tool_calls` deltas; a completion that echoes its prompt sends the
    prompt first."""

    def __init__(self, url: str, job_id: str, created: int, model: str, usage: UsageOptions, tier: str,
                 request: GenerationRequest) -> None:
        n = request.sampling.n
        self.chat = url == CHAT_URL
        self.readers = [AnswerReader(job_id, i, request) for i in range(n)] if self.chat else None
        self.echo = request.prompt if request.echo else None
        # an echo with logprobs holds its chunks until the end, which brings the prompt's logprobs its first one carries
        self.held: list[bytes] | None = [] if self.echo is not None and request.sampling.logprobs is not None else None
        self.head = {"id": f"{CHAT_ID_PREFIX if self.chat else COMPLETION_ID_PREFIX}{job_id}",
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": model, "service_tier": tier}
        self.usage_options = usage
        self.n = n
        self._text_offset = [len(self.echo or "")] * n  # of each choice's next token, for completions' logprobs
        self.prompt_usage: Usage | None = None  # from the first token event (continuous usage)
        self.completion_tokens = [0] * n  # of each choice, sent so far (continuous usage)

    def _event(self, choices: list[dict], **extra) -> bytes:
        chunk = {**self.head, "choices": choices, **extra}
        if self.usage_options.continuous and self.prompt_usage is not None:
            chunk.setdefault("usage", usage_body(self.prompt_usage.model_copy(
                update={"completion_tokens": sum(self.completion_tokens)})))
        if self.usage_options.final:
            chunk.setdefault("usage", None)
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def read_as(self, chat_format: ChatFormat) -> None:
        """Read the answers as the model writes them (a chat job's `start` event names its format; a rerun's `start`
        names the same, and the answers read so far go on)."""
        for reader in self.readers or ():
            reader.read_as(chat_format)

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False,
                logprobs: list[TokenLogprob] | None = None, index: int = 0, calls: list[CallDelta] = (),
                reasoning: str = "") -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            if calls:
                delta["tool_calls"] = [call.to_dict() for call in calls]
            if role:
                delta = {"role": "assistant", "content": ""}
            return {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                    "finish_reason": finish_reason}
        shaped = completion_logprobs(logprobs, self._text_offset[index])
        self._text_offset[index] += sum(len(lp.token) for lp in logprobs or ())
        return {"index": index, "text": text or "", "logprobs": shaped, "finish_reason": finish_reason}

    def _hold(self, chunk: bytes) -> bytes | None:
        if self.held is None:
            return chunk
        self.held.append(chunk)
        return None

    def release(self, prompt_logprobs: list[TokenLogprob | None] | None) -> list[bytes]:
        """A held echo's chunks: the prompt with its logprobs first, then the answer's."""
        logprobs = None if prompt_logprobs is None else echoed_logprobs(self.echo, prompt_logprobs, [])
        echo = self._event([{"index": i, "text": self.echo, "logprobs": logprobs, "finish_reason": None}
                            for i in range(self.n)])
        held, self.held = self.held, None
        return [echo, *held]

    def opening(self) -> bytes | None:
        """The chat stream's first chunk names the role, as OpenAI's does; a completion stream has none, unless it
        echoes its prompt."""
        if not self.chat:
            if self.echo is None or self.held is not None:
                return None
            return self._event([self._choice(self.echo, None, index=i) for i in range(self.n)])
        return self._event([self._choice(None, None, role=True, index=i) for i in range(self.n)])

    def text(self, delta: str, logprobs: list[TokenLogprob] | None = None, index: int = 0) -> bytes | None:
        """A chunk of new text (None while a chat answer's first characters may still open a tool call)."""
        if self.readers is None:
            return self._hold(self._event([self._choice(delta, None, logprobs=logprobs, index=index)]))
        reasoning, content, calls = self.readers[index].feed(delta)
        if not reasoning and not content and not calls and not logprobs:
            return None
        return self._event([self._choice(content or None, None, logprobs=logprobs, index=index, calls=calls,
                                         reasoning=reasoning)])

    def finish(self, ends: list[tuple[str, str | None]]) -> list[bytes]:
        """What a chat answer held back, then the last chunk of each choice with its finish reason (`tool_calls`
        for an answer that made calls) and vLLM's stop_reason: `ends`, each choice's reason and stop string."""
        events, shaped = [], []
        for i, (reason, stop_sequence) in enumerate(ends):
            reason = openai_finish_reason(reason)
            if self.readers is not None:
                reasoning, content, calls = self.readers[i].finish()
                if reasoning or content or calls:
                    events.append(self._event([self._choice(content or None, None, index=i, calls=calls,
                                                            reasoning=reasoning)]))
                if self.readers[i].made_calls and reason == "stop":
                    reason = TOOL_CALLS_FINISH
            shaped.append({**self._choice(None, reason, index=i), "stop_reason": stop_sequence})
        return [*events, self._event(shaped)]

    def usage(self, usage: Usage | None) -> bytes:
        return self._event([], usage=None if usage is None else usage_body(usage))


def error_event(message: str, code: str, type: str = "invalid_request_error") -> bytes:
    return b"data: " + json.dumps(error_body(message, type, code)).encode() + b"\n\n"


async def _relay(request: Request, job_id: str, chunks: Chunks) -> AsyncIterator[bytes]:
    app = request.app
    app.state.metrics.streams.inc()
    ended = False
    relays = [job_streams.TextRelay() for _ in range(chunks.n)]  # one per choice
    attempt_logprobs: list[list[TokenLogprob]] = [[] for _ in range(chunks.n)]  # of the attempt's tokens
    try:
        opening = chunks.opening()
        if opening is not None:
            yield opening
        async for event in app.state.jobs.events(job_id, request.state):
            if event.type == "start" and event.chat_format is not None:
                chunks.read_as(event.chat_format)
            elif event.type == "restart":
                for relay, logprobs in zip(relays, attempt_logprobs):
                    relay.restart()
                    logprobs.clear()
            elif event.type == "token":
                relay, logprobs = relays[event.choice], attempt_logprobs[event.choice]
                sent = len(relay.token_ids)
                delta = relay.delta(event)
                if event.usage is not None:
                    chunks.prompt_usage = event.usage
                chunks.completion_tokens[event.choice] = len(relay.token_ids)
                logprobs += event.logprobs or []
                new_logprobs = logprobs[sent:len(relay.token_ids)] if event.logprobs is not None else None
                if delta or new_logprobs:
                    chunk = chunks.text(delta, new_logprobs, event.choice)
                    if chunk is not None:
                        yield chunk
            elif event.type == "done":
                for relay in relays:
                    relay.check_end()
                ended = True
                if event.finish_reason == "cancelled":
                    yield error_event(CANCELLED_MESSAGE, "cancelled", SERVER_ERROR)
                else:
                    if chunks.held is not None:
                        result = event.result or await app.state.jobs.stored_result(job_id)
                        for chunk in chunks.release(result.prompt_logprobs):
                            yield chunk
                    for chunk in chunks.finish(await _ends(app.state.jobs, job_id, event, chunks.n)):
                        yield chunk
                    if chunks.usage_options.final:
                        yield chunks.usage(event.usage)
            elif event.type == "error":
                ended = True
                yield error_event(event.error or "the request failed", "generation_failed")
        yield DONE
    except job_streams.AttemptDiverged as exc:
        yield error_event(str(exc), "worker_lost", SERVER_ERROR)
        yield DONE
    finally:
        app.state.metrics.streams.dec()
        if not ended:
            await app.state.jobs.cancel(job_id)


async def _ends(jobs: JobService, job_id: str, done: StreamEvent, n: int) -> list[tuple[str, str | None]]:
    """Each choice's finish reason and the stop string that ended it: the end event's, or with n > 1 its result's
    (the stored one only when the event does not carry it)."""
    if n == 1:
        return [(done.finish_reason, None if done.result is None else done.result.stop_sequence)]
    result = done.result or await jobs.stored_result(job_id)
    return [(c.finish_reason, c.stop_sequence) for c in result.choices]


class EventStreamResponse(StreamingResponse):
    """An SSE response that notices a client going away even while nothing is being sent (a job still
    queued), whatever ASGI version the server speaks, and always closes its source (which cancels the job)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
