"""The wire format between producers, workers and consumers (pydantic, no torch).

A job's single argument is `GenerationRequest.model_dump(mode="json")`; a worker validates it
with `GenerationRequest.model_validate` and fails the job with the validation message.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_PROMPT_BYTES = 1 << 20
MAX_PROMPT_TOKEN_IDS = 1 << 17
MAX_TOKENS_LIMIT = 1 << 15
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_MESSAGES = 1024
MAX_METADATA_ITEMS = 64
MAX_MODEL_NAME_CHARS = 256
MAX_CUSTOM_ID_CHARS = 512
DEFAULT_MAX_TOKENS = 256

FinishReason = Literal["stop", "length", "cancelled", "timeout"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingParams(_Strict):
    """How to pick tokens and when to stop. `temperature=0` is greedy decoding."""

    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 20, description="0 turns top-k off")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings_sane(cls, value: list[str]) -> list[str]:
        for s in value:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class BatchItem(_Strict):
    """Where a job sits in a batch: the worker records its outcome under `index` (batcher/batches.py)."""

    id: str
    index: int = Field(ge=0)
    custom_id: str | None = Field(None, max_length=MAX_CUSTOM_ID_CHARS)


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
    deadline: datetime | None = Field(None, description="fail the job if it has not started by then")
    metadata: dict[str, str | int | float | bool] = Field(default_factory=dict, max_length=MAX_METADATA_ITEMS)
    model: str | None = Field(None, min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    chat: bool = False
    batch: BatchItem | None = None
    service_class: Literal["priority", "interactive", "batch"] | None = Field(
        None, description="None: batch for a batch line, interactive otherwise (batcher/service_class.py)")
    tenant: str | None = Field(None, pattern=r"^[A-Za-z0-9_.@-]{1,128}$",
                               description="whose work this is: a gateway key's tenant, a batch's owner")

    @field_validator("prompt_token_ids")
    @classmethod
    def _token_ids_in_range(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 or t >= 1 << 31 for t in value):
            raise ValueError("token ids must be in [0, 2**31)")
        return value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> GenerationRequest:
        given = [n for n in ("prompt", "messages", "prompt_token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages or prompt_token_ids (got {len(given)})")
        if self.chat and self.prompt is None:
            raise ValueError("chat applies to a prompt only (messages are always chat)")
        size = len(self.prompt.encode("utf-8", "surrogatepass")) if self.prompt is not None else 0
        size += sum(len(m.content.encode("utf-8", "surrogatepass")) for m in self.messages or ())
        if size > MAX_PROMPT_BYTES:
            raise ValueError(f"the prompt is {size} bytes; the limit is {MAX_PROMPT_BYTES}")
        return self


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(0, description="Prompt tokens found in the worker's prefix cache, not computed again")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(_Strict):
    """Seconds: waiting in the queue, to the first token, and from admission to the end."""

    queue_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None


class GenerationResult(_Strict):
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings = Field(default_factory=Timings)
    worker: str | None = None
    model: str | None = None


StreamEventType = Literal["start", "token", "done", "error", "restart"]
STREAM_FIELD = "event"


class StreamEvent(BaseModel):
    """One event on a job's token stream (`batcher:stream:<job_id>`).

    `start` when a worker takes the job; `token` with the text delta, the new token ids and the
    index of the first of them in the output; `done` with the finish reason and usage; `error` with
    the reason. A retried job writes `restart` first: readers drop the text of the lost attempt and
    keep only events of the restart's execution. Unknown fields are ignored, so older readers keep
    working when events grow.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: StreamEventType
    execution_id: str | None = Field(None, description="None only on an end written for an execution that is gone "
                                                       "(by the worker that recovered its job, or inferred by a reader)")
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    index: int = 0
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None

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
