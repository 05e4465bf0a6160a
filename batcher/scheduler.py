"""Iteration-level scheduling: each step decides `{sequence: tokens to compute}` (pure Python).

`schedule()` decides what the next forward computes; `update()` takes what it sampled and advances
every sequence (computed tokens, new tokens, timestamps, EOS and length stops). The engine between the
two only executes, so all sequence state changes here.

Continuous policy, every step:
  1. running decodes take one token each, then running prefills take their next prompt chunk;
  2. waiting sequences are admitted in FIFO order while slots, the token budget and KV blocks allow,
     a long prompt with only the chunk that fits (chunked prefill);
  3. when KV blocks run out, the latest-admitted running sequence is preempted by recompute:
     its blocks are freed and it goes back to the front of the queue.
The static policy is the baseline: it admits only into an empty batch and prefills whole prompts.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from batcher.blocks import BlockAllocator
from batcher.config import EngineConfig
from batcher.schema import SamplingParams


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
    first_scheduled_step: int | None = None
    finished_step: int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0

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


@dataclass
class ScheduledBatch:
    """What one step computes: tokens per sequence (in execution order) and who was preempted."""

    num_tokens: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def samples(self, seq: Sequence) -> bool:
        """Whether `seq` samples a token this step: its prompt (and output so far) is then fully computed."""
        return seq.num_computed_tokens + self.num_tokens[seq] == seq.num_tokens

    def __bool__(self) -> bool:
        return bool(self.num_tokens)


class Scheduler:
    """Owns every sequence's state: `add`, then `schedule()` and `update()` once per step, `finish` to end one early.

    `eos_token_ids` end a sequence (unless it ignores EOS); `max_model_len` caps prompt plus output."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator, eos_token_ids: frozenset[int] = frozenset(),
                 max_model_len: int | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_slots(self) -> int:
        return max(0, self.config.max_num_seqs - len(self.running) - len(self.waiting))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence from the batch or the queue and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def update(self, batch: ScheduledBatch, sampled: dict[Sequence, int], now: float | None = None) -> list[Sequence]:
        """Advance the sequences of `batch` after its forward: every one computed its scheduled tokens, and
        each one in `sampled` got its next token at `now`. Return the sequences this finished (EOS, length)."""
        now = time.monotonic() if now is None else now
        for seq, n in batch.num_tokens.items():
            seq.num_computed_tokens += n
        finished = []
        for seq, token in sampled.items():
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_token_ids and not seq.sampling.ignore_eos:
            return "stop"
        if seq.num_output_tokens >= seq.sampling.max_tokens:
            return "length"
        if self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def schedule(self) -> ScheduledBatch:
        static = self.config.policy == "static"
        limit = float("inf") if static else self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        admit = not static or not self.running

        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            budget = limit - batch.total_tokens
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = int(min(seq.num_uncomputed_tokens, budget))
            if self._reserve(seq, n, batch):
                batch.num_tokens[seq] = n

        while admit and not batch.preempted and self.waiting:
            budget = limit - batch.total_tokens
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            n = int(min(seq.num_uncomputed_tokens, budget))
            if not self.allocator.can_grow(seq.block_table, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.allocator.grow(seq.block_table, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.num_tokens[seq] = n
        return batch

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Grow `seq`'s blocks for `n` more tokens, preempting the latest admitted until they fit."""
        target = seq.num_computed_tokens + n
        while not self.allocator.can_grow(seq.block_table, target):
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)
            batch.num_tokens.pop(victim, None)
            if victim is seq:
                return False
        self.allocator.grow(seq.block_table, target)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV blocks and requeue at the front."""
        self.running.remove(seq)
        self.allocator.release(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
