"""The engine's interface, as the worker, the metrics and the offline runner use it (no torch here).

`rqbatcher.workers.engine.engine.Engine` implements `EngineProtocol`; so does the test suite's fake engine, and a test
checks that both still match it. Only plain data crosses it: what one step produces for one request is a
`RequestOutput` (with the request's times), and `stats()` returns an `EngineStats` snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rqbatcher.config import DEFAULT_QUANTIZATION
from rqbatcher.schema import ChatFormat, Choice, GenerationRequest, GenerationResult, Timings, TokenLogprob, Usage
from rqbatcher.workers.scheduler.blocks import PrefixCacheStats


class RequestError(ValueError):
    """A request the engine cannot serve (too long, bad token ids, no chat template...)."""


@dataclass
class RequestOutput:
    """What one step produced for one request. `text` and `token_ids` are the totals so far."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason `stop`)
    error: str | None = None
    new_logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when the request asked
    logprobs: list[TokenLogprob] | None = None  # of token_ids
    choice: int = 0  # which of the request's n answers this is
    choices: list[Choice] | None = None  # every answer, on the last output of a request with n > 1
    completion_tokens: int | None = None  # with best_of: every candidate's tokens; None: the answers' own
    embeddings: list[str] | None = None  # an embedding request's vectors (OpenAI's base64), on its last output
    prompt_token_ids: list[int] | None = None  # the prompt as tokenized, when the request asked (tokenize_only)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, on the last output, when asked
    # The request's times (time.monotonic()): added to the engine, its first token, its latest token.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def prompt_usage(self) -> Usage:
        """The prompt's part of the usage (what a choice's first token event carries)."""
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=0, cached_tokens=self.num_cached_tokens)

    def to_result(self, timings: Timings | None = None, worker: str | None = None, model: str | None = None,
                  chat_format: ChatFormat | None = None) -> GenerationResult:
        """The wire-format result of a request that finished (with n > 1, the top-level fields are choice 0's;
        with best_of, usage counts every candidate's tokens). `chat_format`: how a chat answer is read."""
        first = self.choices[0] if self.choices else self
        completion_tokens = (self.completion_tokens if self.completion_tokens is not None
                             else sum(len(c.token_ids) for c in self.choices) if self.choices else len(self.token_ids))
        return GenerationResult(
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            stop_sequence=first.stop_sequence,
            usage=Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion_tokens,
                        cached_tokens=self.num_cached_tokens),
            timings=timings or Timings(),
            worker=worker,
            model=model,
            logprobs=first.logprobs,
            choices=self.choices,
            embeddings=self.embeddings,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            chat_format=chat_format,
        )

    @classmethod
    def tokenized(cls, request_id: str, request: GenerationRequest, prompt_ids: list[int], loaded,
                  arrival_time: float) -> RequestOutput:
        """A tokenize_only request's answer, with no token generated: the prompt's ids as the engine rendered it
        (any length: a count is no generation), and, for a request that gave token ids, their text. `loaded` is the
        engine's model (its tokenizer and vocab_size)."""
        bad = next((t for t in prompt_ids if t >= loaded.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (size {loaded.vocab_size})")
        text = "" if request.prompt_token_ids is None else loaded.tokenizer.decode(prompt_ids)
        return cls(request_id, [], "", text, [], len(prompt_ids), finish_reason="stop", prompt_token_ids=prompt_ids,
                   arrival_time=arrival_time)


@dataclass
class StepStats:
    """What the last step computed, for metrics and benchmarks."""

    step: int
    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_preempted: int
    duration_s: float
    mix: str = ""  # the classes of work the step carried, most urgent first: "interactive+batch"
    prompt_token_budget: int = 0  # batch prompt tokens the step could take: the step-time target's, else the full one
    urgent_prompt_tokens: int = 0  # prompt tokens it gave to priority and interactive work (and prefills they await)
    batch_prompt_tokens: int = 0  # prompt tokens it gave to batch work
    target_infeasible: bool = False  # the given step-time target was below its decodes' cost: the measured one ran


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine, for metrics and the figures a worker publishes."""

    num_running: int
    num_waiting: int
    free_slots: int
    kv_cache_usage: float  # fraction of KV-cache blocks in use
    prefix_cache: PrefixCacheStats  # prompt tokens looked up in the prefix cache, and found there, since the start
    dtype: str  # the dtype the model runs in, e.g. "bfloat16" (never "auto")
    last_step: StepStats | None
    quantization: str = DEFAULT_QUANTIZATION  # its linears' weights (EngineConfig.quantization)
    urgency_preemptions: dict[str, int] = field(default_factory=dict)  # since the start, by the preempted's class
    fairness_preemptions: int = 0  # since the start: interactive sequences that gave way to another tenant's
    step_time_target_s: float = 0.0  # the last step's target (given or measured; 0: none bound it)
    prefix_blocks_awaited: int = 0  # since the start: cached blocks sequences waited for a running prefill to fill
    recent_step_s: float = 0.0  # a moving average of the steps' measured wall time
    vocab_size: int = 0  # the model's logits' width: what logit_bias ids must stay below (0: unknown)
    tasks: str = "generate"  # what it serves, comma-separated: generate, embed
    embedding_size: int = 0  # its embeddings' length (the model's hidden size); 0: it does not embed
    matryoshka_dimensions: str = ""  # other lengths its embeddings can be cut to: "" none, "any", or a list
    max_model_len: int = 0  # the most tokens a sequence holds, prompt and answer (0: unknown)


@dataclass(frozen=True)
class Progress:
    """What an earlier attempt of a request already generated for one choice, as its stream holds it: a rerun
    continues from here instead of starting over (`logprobs` when the request asked for them)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class LoadedModelInfo(Protocol):
    name: str


@runtime_checkable
class EngineProtocol(Protocol):
    """`add` requests, `step` until `has_work` is false, `abort` one early. One thread drives it."""

    loaded: LoadedModelInfo
    chat_format: ChatFormat  # how the model writes calls and reasoning (workers/engine/chat_format.py)

    def add(self, request_id: str, request: GenerationRequest, arrival_time: float | None = None,
            progress: dict[int, Progress] | None = None) -> None:
        """Queue a request; raise RequestError, keeping nothing, if it can never be served. `progress` (by choice)
        is what an earlier attempt generated: the request goes on from there."""

    def step(self) -> list[RequestOutput]:
        """Run one scheduling decision and one forward; an output for every request that changed."""

    def abort(self, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        """End a request now, keeping what it generated; None if the engine does not hold it."""

    def has_work(self) -> bool: ...

    @property
    def free_slots(self) -> int:
        """How many more requests could join without waiting for a slot."""

    @property
    def urgent_room(self) -> int:
        """How many priority or interactive requests could join beyond the free slots, each to preempt batch work."""

    @property
    def fair_room(self) -> int:
        """How many interactive requests of a tenant holding no slot could join beyond the free slots, each to
        preempt one sequence of the most-served tenant (0 or 1)."""

    @property
    def batch_deficit(self) -> int:
        """How many batch requests to take before any other: what batch work lacks of its minimum share."""

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state."""
