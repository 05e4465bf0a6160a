"""An engine with no model (it satisfies `workers.engine.api.EngineProtocol`): what the job system costs alone.

Each request generates one token per step: token i of its output is `FIRST_TOKEN + i`, whose text is one letter.
With `embeds`, it serves embedding requests too, all in their first step: each input's vector (`letter_vector`) has
EMBEDDING_SIZE numbers derived from the input alone, and any shorter `dimensions` (a Matryoshka model's).
A tokenize_only request is answered by the next step, without a slot, as the real engine answers it: its tokens are its
prompt's characters (`letter_prompt_ids`).
The test suite's fake engine builds on it, and `python -m benchmarks.job_rate` measures the worker's jobs per second
on it (from a checkout: the wheel ships neither).
"""

from __future__ import annotations

import base64
import math
import struct
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from rqbatcher.schema import ChatFormat, GenerationRequest
from rqbatcher.workers.engine.api import EngineStats, Progress, RequestError, RequestOutput, StepStats
from rqbatcher.workers.scheduler.blocks import PrefixCacheStats

FIRST_TOKEN = 65  # "A"
EMBEDDING_SIZE = 8
TASKS_GENERATE, TASKS_BOTH = "generate", "generate,embed"
LETTER_VOCAB_SIZE = sys.maxunicode + 1  # a token per character


def letter_vector(item: str | list[int], dimensions: int | None = None) -> list[float]:
    """An input's vector: unit length, from its characters' (or token ids') values, cut to `dimensions`."""
    values = [ord(c) for c in item] if isinstance(item, str) else list(item)
    raw = [1.0 + sum(v for v in values[i::EMBEDDING_SIZE]) for i in range(EMBEDDING_SIZE)][: dimensions]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


def encode_vector(vector: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def letter_prompt_ids(request: GenerationRequest) -> list[int]:
    """A prompt's tokens as this engine reads it: its characters; messages rendered `role: content` a line each, after
    a line naming the tools, and an `assistant:` line to answer on (a template's generation prompt)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if request.messages is None:
        return [ord(c) for c in request.prompt]
    tools = f"tools: {','.join(t.function.name for t in request.tools)}\n" if request.tools else ""
    lines = "".join(f"{m.role}: {m.content or ''}\n" for m in request.messages)
    return [ord(c) for c in f"{tools}{lines}assistant:"]


@dataclass
class LetterRequest:
    request: GenerationRequest
    arrival_time: float
    generated: list[int] = field(default_factory=list)
    first_at: float | None = None
    last_at: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        if self.request.embed is not None:
            return sum(len(item) for item in self.request.embed)
        return len(self.request.prompt_token_ids or self.request.prompt or "x")


class LetterEngine:
    def __init__(self, max_num_seqs: int = 4, name: str = "letter-model", embeds: bool = False) -> None:
        self.chat_format = ChatFormat()  # a completion model's: no tool format of its own, no reasoning
        self.loaded = SimpleNamespace(name=name, vocab_size=LETTER_VOCAB_SIZE,
                                      tokenizer=SimpleNamespace(decode=lambda ids: "".join(map(chr, ids))))
        self.embeds = embeds
        self.max_num_seqs = max_num_seqs
        self.step_index = 0
        self.last_step: StepStats | None = None
        self.prefix_cache_stats = PrefixCacheStats()
        self.requests: dict[str, LetterRequest] = {}
        self.ready: list[RequestOutput] = []  # tokenize_only answers, for the next step

    def add(self, request_id: str, request: GenerationRequest, arrival_time: float | None = None,
            progress: dict[int, Progress] | None = None) -> None:
        """Queue a request; with `progress`, it goes on after the letters an earlier attempt generated."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        if request.embed is not None and not self.embeds:
            raise RequestError("this worker does not serve embed jobs: it serves generate")
        if request.dimensions is not None and request.dimensions > EMBEDDING_SIZE:
            raise RequestError(f"dimensions={request.dimensions} is not available: this model's embeddings can have "
                               f"any length up to {EMBEDDING_SIZE}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if request.tokenize_only:
            self.ready.append(RequestOutput.tokenized(request_id, request, letter_prompt_ids(request), self.loaded,
                                                      arrival))
            return
        prior = (progress or {}).get(0)
        self.requests[request_id] = LetterRequest(request, arrival, list(prior.token_ids) if prior else [])

    def has_work(self) -> bool:
        return bool(self.requests or self.ready)

    @property
    def free_slots(self) -> int:
        return max(0, self.max_num_seqs - len(self.requests))

    @property
    def urgent_room(self) -> int:
        return 0  # no preemption: it takes only what its slots hold

    @property
    def fair_room(self) -> int:
        return 0

    @property
    def batch_deficit(self) -> int:
        return 0

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.requests), num_waiting=0, free_slots=self.free_slots,
                           kv_cache_usage=len(self.requests) / self.max_num_seqs,
                           prefix_cache=self.prefix_cache_stats, dtype="float32", last_step=self.last_step,
                           tasks=TASKS_BOTH if self.embeds else TASKS_GENERATE,
                           embedding_size=EMBEDDING_SIZE if self.embeds else 0,
                           matryoshka_dimensions="any" if self.embeds else "")

    def step(self) -> list[RequestOutput]:
        advanced = [self.advance(request_id, req) for request_id, req in list(self.requests.items())]
        outputs, self.ready = self.ready + advanced, []
        self.last_step = StepStats(step=self.step_index, num_seqs=len(advanced), num_tokens=len(advanced),
                                   num_prefill_tokens=0, num_preempted=0, duration_s=0.0)
        self.step_index += 1
        return outputs

    def advance(self, request_id: str, req: LetterRequest) -> RequestOutput:
        """One step of one request: its next letter, and its end once it has `max_tokens` of them (an embedding
        request: its vectors, and its end)."""
        if req.request.embed is not None:
            del self.requests[request_id]
            req.first_at = req.last_at = time.monotonic()
            out = self.output(request_id, req, [], finish_reason="stop")
            out.embeddings = [encode_vector(letter_vector(item, req.request.dimensions)) for item in req.request.embed]
            return out
        new = [FIRST_TOKEN + len(req.generated)] if len(req.generated) < req.request.sampling.max_tokens else []
        req.generated += new
        req.last_at = time.monotonic()
        req.first_at = req.first_at or req.last_at
        done = len(req.generated) >= req.request.sampling.max_tokens
        if done:
            del self.requests[request_id]
        return self.output(request_id, req, new, finish_reason="length" if done else None)

    def abort(self, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        return None if req is None else self.output(request_id, req, [], finish_reason=reason)

    @staticmethod
    def output(request_id: str, req: LetterRequest, new: list[int], finish_reason: str | None = None,
               error: str | None = None) -> RequestOutput:
        return RequestOutput(request_id=request_id, new_token_ids=new, delta_text="".join(map(chr, new)),
                             text="".join(map(chr, req.generated)), token_ids=list(req.generated),
                             num_prompt_tokens=req.num_prompt_tokens, finish_reason=finish_reason, error=error,
                             arrival_time=req.arrival_time, first_token_time=req.first_at, last_token_time=req.last_at)
