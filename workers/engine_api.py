"""The engine's interface, as the worker, the metrics and the offline runner use it (no torch here).

`workers.engine.Engine` implements `EngineProtocol`; so does the test suite's fake engine, and a test
checks that both still match it. What one step produces for one request is a `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from batcher.blocks import PrefixCacheStats
from batcher.scheduler import Sequence
from batcher.schema import GenerationRequest, GenerationResult, Timings, Usage


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
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def to_result(self, timings: Timings | None = None, worker: str | None = None,
                  model: str | None = None) -> GenerationResult:
        """The wire-format result of a request that finished."""
        return GenerationResult(
            text=self.text,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            usage=Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=len(self.token_ids),
                        cached_tokens=self.num_cached_tokens),
            timings=timings or Timings(),
            worker=worker,
            model=model,
        )


@dataclass
class StepStats:
    """What the last step computed, for metrics and benchmarks."""

    step: int
    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_preempted: int
    duration_s: float


class LoadedModelInfo(Protocol):
    name: str


@runtime_checkable
class EngineProtocol(Protocol):
    """`add` requests, `step` until `has_work` is false, `abort` one early. One thread drives it."""

    loaded: LoadedModelInfo
    step_index: int
    last_step: StepStats | None

    def add(self, request_id: str, request: GenerationRequest, arrival_time: float | None = None) -> Sequence:
        """Queue a request; raise RequestError, keeping nothing, if it can never be served."""

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
    def urgency_preemptions(self) -> dict[str, int]:
        """Sequences preempted for more urgent work since the engine started, by their class."""

    @property
    def batch_deficit(self) -> int:
        """How many batch requests to take before any other: what batch work lacks of its minimum share."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks in use."""

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache, and found there, since the engine started."""

    @property
    def dtype(self) -> str:
        """The dtype the model runs in, e.g. "bfloat16" (never "auto")."""
