"""A sequence: one request inside the engine, with its tokens, progress, KV blocks and times.

The scheduler (`batcher.scheduler`) is the only writer of a sequence's fields: it admits, advances, preempts and
finishes sequences. Everything outside the engine sees a request through the plain outputs and snapshots the
engine returns (`workers.engine.api`), never a live sequence.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from batcher.schema import SamplingParams
from batcher.service_class import INTERACTIVE, RANK


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: its tokens, progress, KV blocks and timestamps."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its first full blocks, as far as needed so far
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first admitted
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    fairness_preempted_at: int | None = None  # the scheduler's step of its latest preemption for fairness
    service_class: str = INTERACTIVE  # batcher/service_class.py
    urgency: tuple[int, int] = (RANK[INTERACTIVE], 0)  # (class rank, priority level), lower first
    tenant: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
