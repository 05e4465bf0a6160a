"""The wire format between producers, workers and consumers (pydantic, no torch).

A job's single argument is `GenerationRequest.model_dump(mode="json")`; a worker validates it
with `GenerationRequest.model_validate` and fails the job with the validation message.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rqbatcher import constraints, reasoning
from rqbatcher.errors import quoted
from rqbatcher.response_format import ResponseFormat
from rqbatcher.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from rqbatcher.service_class import ServiceClass
from rqbatcher.tools import definitions as tool_defs
from rqbatcher.tools.definitions import Tool, ToolCall, ToolChoice
from rqbatcher.tools.formats import DEFAULT_FORMAT, ToolFormat
from rqbatcher.tools.grammar import tool_grammar

MAX_PROMPT_BYTES = 1 << 20
MAX_PROMPT_TOKEN_IDS = 1 << 17
MAX_MESSAGES = 1024
MAX_REQUEST_METADATA_ITEMS = 64  # a request's own metadata (a batch's, as OpenAI limits it: batches/batch_object.py)
MAX_MODEL_NAME_CHARS = 256
MAX_USER_CHARS = 256  # OpenAI's `user`: who the end user is, kept with the job
MAX_CUSTOM_ID_CHARS = 512
MAX_EMBED_INPUTS = 2048  # OpenAI's limit of inputs in one embeddings request
RESPONSE_ID_PATTERN = r"^resp_[A-Za-z0-9]{1,64}$"

FinishReason = Literal["stop", "length", "cancelled", "timeout"]
DEFAULT_TOOL_FORMAT = "batcher"  # the Hermes-style format batcher's grammar writes on a template without tools


class _Strict(BaseModel):
    """What producers send (requests): an unknown field is an error, so a typo never passes silently, and a value of
    another type is an error too (`"4"` is not 4, `true` is not 1), as OpenAI's API refuses them. JSON keeps every
    type but a datetime, so a job read back from Redis validates as it was sent."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Tolerant(BaseModel):
    """What consumers read (results, usage, stream events): fields a newer worker added are ignored, so workers
    can be upgraded before the clients that read them (a rolling upgrade)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class ChatMessage(_Strict):
    """One turn. An assistant's turn may carry the tool calls it made (its content then may be None); a `tool`
    turn answers one of them by `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1, max_length=tool_defs.MAX_TOOL_CALLS_PER_MESSAGE)
    tool_call_id: str | None = Field(None, min_length=1, max_length=tool_defs.MAX_CALL_ID_CHARS)

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message carries the tool_call_id it answers, and only a tool message does")
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs content")
        return self


class BatchItem(_Strict):
    """Where a job sits in a batch: the worker records its outcome under `index` (batcher/batches.py)."""

    id: str
    index: int = Field(ge=0)
    custom_id: str | None = Field(None, max_length=MAX_CUSTOM_ID_CHARS)
    url: str | None = Field(None, description="the line's endpoint; None: chat for messages, completions otherwise")
    encoding_format: Literal["float", "base64"] | None = Field(None, description="an embeddings line's vector format")


class GenerationRequest(_Strict):
    """One generation: exactly one of `prompt`, `messages` or `prompt_token_ids`.

    `model` routes the job to the workers that serve that model (None: any worker of the queue).
    `chat` sends `prompt` as one user message through the model's chat template when it has one:
    only the worker knows its tokenizer, and a job may wait in the queue before any worker is up."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    prompt_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(0, ge=0, le=9, description="0 is the most urgent")
    timeout_s: float | None = Field(None, gt=0, le=7 * 86400, description="longest run time once admitted")
    deadline: datetime | None = Field(None, strict=False, description="fail the job if it has not started by then "
                                                                      "(ISO 8601 text in JSON)")
    metadata: dict[str, str | int | float | bool] = Field(default_factory=dict, max_length=MAX_REQUEST_METADATA_ITEMS)
    model: str | None = Field(None, min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    chat: bool = False
    batch: BatchItem | None = None
    service_class: ServiceClass | None = Field(
        None, description="None: batch for a batch line, interactive otherwise (batcher/service_class.py)")
    tenant: str | None = Field(None, pattern=r"^[A-Za-z0-9_.@-]{1,128}$",
                               description="whose work this is: a gateway key's tenant, a batch's owner")
    response_format: ResponseFormat | None = None
    regex: str | None = Field(None, min_length=1, description="the whole answer matches this regex")
    choice: list[str] | None = Field(None, description="the whole answer is one of these strings")
    tools: list[Tool] | None = Field(None, min_length=1, max_length=tool_defs.MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(None, description="None: auto with tools, none without (OpenAI's default)")
    parallel_tool_calls: bool = True
    user: str | None = Field(None, max_length=MAX_USER_CHARS, description="who the end user is (OpenAI's `user`)")
    echo: bool = Field(False, description="the answer's text begins with the prompt (a text prompt only)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="the prompt's logprobs (vLLM's)")
    chat_template_kwargs: reasoning.TemplateKwargs = Field(
        default_factory=dict, max_length=reasoning.MAX_TEMPLATE_KWARGS, description="the chat template's variables")
    tokenize_only: bool = Field(False, description="generate nothing: answer at once with the prompt as the worker "
                                                   "renders it (its ids; given ids, their text): /tokenize /detokenize")
    embed: list[str | list[int]] | None = Field(
        None, min_length=1, max_length=MAX_EMBED_INPUTS,
        description="texts or token ids to embed instead of generating: a prefill-only job, one vector each")
    dimensions: int | None = Field(None, ge=1, description="embed: the vectors' length, where the model can shorten "
                                                           "them (Matryoshka); None: the model's own")
    background_response: str | None = Field(None, pattern=RESPONSE_ID_PATTERN,
                                            description="the background response this job runs: its end is "
                                                        "announced to its tenant's webhooks")

    @field_validator("deadline")
    @classmethod
    def _deadline_in_utc(cls, value: datetime | None) -> datetime | None:
        """A deadline without a time zone is read as UTC, so every reader compares it the same way."""
        return value.replace(tzinfo=timezone.utc) if value is not None and value.tzinfo is None else value

    @field_validator("response_format")
    @classmethod
    def _format_honoured(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        if value is not None:
            value.grammar()
        return value

    @field_validator("regex")
    @classmethod
    def _regex_honoured(cls, value: str | None) -> str | None:
        if value is not None:
            constraints.regex_grammar(value)
        return value

    @field_validator("choice")
    @classmethod
    def _choice_honoured(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            constraints.choice_grammar(value)
        return value

    @field_validator("messages")
    @classmethod
    def _tool_results_answer_calls(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        called: set[str] = set()
        for i, message in enumerate(value or ()):
            called |= {call.id for call in message.tool_calls or ()}
            if message.role == "tool" and message.tool_call_id not in called:
                raise ValueError(f"message {i} answers the tool call {quoted(message.tool_call_id)}, which no earlier "
                                 "assistant message made")
        return value

    @field_validator("tools")
    @classmethod
    def _tool_names_unique(cls, value: list[Tool] | None) -> list[Tool] | None:
        duplicate = tool_defs.duplicate_name(value) if value else None
        if duplicate is not None:
            raise ValueError(f"two tools are named {duplicate!r}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: ToolChoice | None, info) -> ToolChoice | None:
        problem = tool_defs.choice_problem(info.data.get("tools"), value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may be tool calls (tools given, and tool_choice is not `none`)."""
        return bool(self.tools) and tool_defs.effective_choice(self.tools, self.tool_choice) != "none"

    def grammar(self, reasoning_format: str | None = None, tool_format: ToolFormat = DEFAULT_FORMAT) -> str | None:
        """The llguidance grammar the answer must follow, or None when it is free text; for a model that thinks
        (`reasoning_format`, batcher/reasoning.py) it starts after the reasoning."""
        thinks = (self.messages is not None or self.chat) and reasoning.thinking_enabled(self.chat_template_kwargs)
        return reasoning.after_reasoning(self._answer_grammar(tool_format), reasoning_format if thinks else None,
                                         self.sampling.max_tokens)

    def _answer_grammar(self, tool_format: ToolFormat) -> str | None:
        if self.calls_tools:  # calls in the served model's format (batcher/tools/formats.py)
            return tool_grammar(self.tools, tool_defs.effective_choice(self.tools, self.tool_choice),
                                self.parallel_tool_calls, self._text_schema(), tool_format)
        if self.regex is not None:
            return constraints.regex_grammar(self.regex)
        if self.choice is not None:
            return constraints.choice_grammar(self.choice)
        return None if self.response_format is None else self.response_format.grammar()

    def _text_schema(self) -> dict | None:
        """The JSON schema a text answer follows, when response_format asks for JSON."""
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return constraints.ANY_JSON_OBJECT
        return self.response_format.json_schema.schema_ or {}

    def _check_embed(self) -> None:
        """An embedding job reads its inputs and nothing that shapes generated text."""
        for i, item in enumerate(self.embed):
            if isinstance(item, str) and not item:
                raise ValueError(f"embed[{i}] is an empty string")
            if isinstance(item, list) and (not item or any(t < 0 or t >= 1 << 31 for t in item)):
                raise ValueError(f"embed[{i}]: a list of token ids is not empty and each id is in [0, 2**31)")
        shaping = [n for n in ("chat", "echo", "tools", "response_format", "regex", "choice")
                   if getattr(self, n) not in (None, False)]
        if shaping or self.sampling != SamplingParams():
            raise ValueError(f"an embedding job takes no {', '.join(shaping) or 'sampling'}: it generates no text")

    @field_validator("prompt_token_ids")
    @classmethod
    def _token_ids_in_range(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 or t >= 1 << 31 for t in value):
            raise ValueError("token ids must be in [0, 2**31)")
        return value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> GenerationRequest:
        given = [n for n in ("prompt", "messages", "prompt_token_ids", "embed") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, prompt_token_ids or embed (got {len(given)})")
        if self.embed is not None:
            self._check_embed()
        elif self.dimensions is not None:
            raise ValueError("dimensions goes with embed")
        if self.chat and self.prompt is None:
            raise ValueError("chat applies to a prompt only (messages are always chat)")
        size = len(self.prompt.encode("utf-8", "surrogatepass")) if self.prompt is not None else 0
        size += sum(len((m.content or "").encode("utf-8", "surrogatepass")) for m in self.messages or ())
        size += sum(len(x.encode("utf-8", "surrogatepass")) for x in self.embed or () if isinstance(x, str))
        if size > MAX_PROMPT_BYTES:
            raise ValueError(f"the prompt is {size} bytes; the limit is {MAX_PROMPT_BYTES}")
        constrained = [n for n in ("regex", "choice") if getattr(self, n) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            constrained.append("response_format")
        if len(constrained) > 1:
            raise ValueError(f"give at most one of response_format, regex or choice (got {', '.join(constrained)})")
        if self.tools and self.messages is None:
            raise ValueError("tools go with messages (a chat request)")
        if self.calls_tools and (self.regex is not None or self.choice is not None):
            raise ValueError("tools cannot go with regex or choice: give tool_choice none, or drop them")
        if self.calls_tools:
            constrained.append("tools")
        if self.echo and self.prompt is None:
            raise ValueError("echo repeats a text prompt: give prompt, not messages or token ids")
        if self.sampling.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise ValueError("max_tokens 0 (the prompt alone) goes with echo or prompt_logprobs; else it is at least 1")
        if constrained and self.sampling.ignore_eos:
            raise ValueError(f"ignore_eos cannot go with {constrained[0]}: a constrained answer ends with its grammar")
        shaping = [n for n in ("embed", "echo", "regex", "choice", "response_format")
                   if getattr(self, n) not in (None, False)]
        if self.tokenize_only and (shaping or self.sampling != SamplingParams()):
            raise ValueError(f"tokenize_only takes no {shaping[0] if shaping else 'sampling'}: it generates nothing")
        return self


class Usage(_Tolerant):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(0, description="Prompt tokens found in the worker's prefix cache, not computed again")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(_Tolerant):
    """Seconds: waiting in the queue, to the first token, and from admission to the end."""

    queue_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None


class TopLogprob(_Tolerant):
    token: str
    logprob: float
    token_id: int | None = None  # given where a reader keys by it (vLLM's prompt_logprobs)


class TokenLogprob(_Tolerant):
    """One generated token's log-probability, and the most likely alternatives at its position.

    The distribution is the model's log-softmax at that position, over the tokens the request's grammar allows
    (all of them without a constraint), before logit_bias, the penalties, temperature, top-k and top-p: what the
    model thinks, not how the token was drawn (a token a -100 bias bans may be listed). `token` is the token
    decoded alone (a token inside a multi-byte character decodes to U+FFFD)."""

    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)
    rank: int | None = None  # of the token in the distribution, 1 the likeliest (given in prompt_logprobs)


class Choice(_Tolerant):
    """One of a request's `n` answers."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stop_sequence: str | None = None  # as the result's
    logprobs: list[TokenLogprob] | None = None


class ChatFormat(_Tolerant):
    """How the served model writes tool calls and marks its reasoning, found by the worker from its chat template
    and tokenizer (workers/engine/chat_format.py), so every reader (the gateway, batch lines) reads an answer as the
    model wrote it. It rides on a job's `start` event and on its result."""

    tools: str = Field(DEFAULT_TOOL_FORMAT, description="the tool-call format's name (batcher/tools/formats.py)")
    reasoning: str | None = Field(None, description="the reasoning markers' name, None for a model that does not "
                                                    "think (batcher/reasoning.py)")


class GenerationResult(_Tolerant):
    """A request's answer. With `n` > 1, `choices` holds every answer, the top-level fields are choice 0's, and
    `usage.completion_tokens` counts the tokens of all of them."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stop_sequence: str | None = Field(None, description="the request's stop string that ended the text")
    usage: Usage
    timings: Timings = Field(default_factory=Timings)
    worker: str | None = None
    model: str | None = None
    logprobs: list[TokenLogprob] | None = Field(None, description="one per token, when the request asked")
    choices: list[Choice] | None = Field(None, description="every answer, when the request asked for n > 1")
    embeddings: list[str] | None = Field(None, description="embed: each input's vector in input order, base64 of "
                                                           "little-endian float32 (OpenAI's base64 encoding)")
    prompt_token_ids: list[int] | None = Field(None, description="the prompt as the worker tokenized it, when the "
                                                                 "request asked (tokenize jobs, prompt logprobs)")
    prompt_logprobs: list[TokenLogprob | None] | None = Field(None, description="one per prompt token; the first None")
    chat_format: ChatFormat | None = Field(None, description="how the model writes calls and reasoning (chat jobs)")


StreamEventType = Literal["start", "token", "done", "error", "restart"]
STREAM_FIELD = "event"


class StreamEvent(_Tolerant):
    """One event on a job's token stream (`batcher:stream:<job_id>`).

    `start` when a worker takes the job; `token` with the text delta, the new token ids and the
    index of the first of them in the output (a choice's first token event, at index 0, also carries the
    prompt's `usage`, its completion_tokens 0: what vLLM's `continuous_usage_stats` needs); `done` with the
    finish reason and usage; `error` with the reason.

    A job rerun after a crash or a lost lease goes on where its stream stopped: its execution writes `start`,
    then the next tokens (their `index` continues), so a reader sees one uninterrupted text; readers keep only
    events of the execution of the latest `start` or `restart` (`rqbatcher.jobs.stream.AttemptFilter`). `restart`
    is rare: a rerun writes it first only when its stream cannot be continued (trimmed, or a gap a failover
    left); readers then drop the text so far. Unknown fields are ignored, so older readers keep working when
    events grow.
    """

    type: StreamEventType
    execution_id: str | None = Field(None, description="None only on an end written for an execution that is gone "
                                                       "(by the worker that recovered its job, or inferred by a "
                                                       "reader)")
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    index: int = 0
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = Field(None, description="of `token_ids`, when the request asked")
    choice: int = Field(0, description="which of the request's n answers a token event belongs to")
    result: GenerationResult | None = Field(None, description="on `done`: the whole result, every choice's finish "
                                                              "reason included, so a reader needs no second read")
    chat_format: ChatFormat | None = Field(None, description="on `start` of a chat job: how the model writes calls "
                                                             "and reasoning, so a stream reader parses them")

    @property
    def terminal(self) -> bool:
        return self.type in ("done", "error")

    def to_fields(self) -> dict[str, str]:
        """The stream entry: one JSON field, without defaults, to keep token events small."""
        return {STREAM_FIELD: self.model_dump_json(exclude_defaults=True)}

    @classmethod
    def from_fields(cls, fields: dict) -> StreamEvent:
        raw = fields.get(STREAM_FIELD.encode(), fields.get(STREAM_FIELD))
        return cls.model_validate_json(raw)
