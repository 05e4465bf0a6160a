"""Iteration-level scheduling: each step decides `{sequence: tokens to compute}` (pure Python).

`schedule()` decides what the next forward computes (a `StepPlan`); `update()` takes what it sampled and
advances every sequence (computed tokens, new tokens, timestamps, EOS and length stops); `finish()` ends one
early (a stop string, a cancel, a failure). The engine between them only executes, so every change of a
sequence's state (`rqbatcher.workers.scheduler.sequence`) is made here.

Continuous policy, every step:
  0. a waiting sequence of a more urgent class that no slot or KV block would admit preempts the least
     urgent running one (workers/scheduler/preemption.py: bounded so that batch work keeps its minimum share),
     and an interactive one of a tenant holding no slot preempts one of the most-served tenant's (fairness,
     each sequence at most once per FAIRNESS_INTERVAL_S, so every such request is admitted within it);
  1. running decodes take one token each, then running prefills take their next prompt chunk (those of a
     less urgent class than a waiting sequence only after the waiting are admitted);
  2. waiting sequences are admitted most urgent first (FIFO among equals) while slots, the token budget and
     KV blocks allow, a long prompt with only the chunk that fits (chunked prefill);
  3. when KV blocks run out, the least urgent (latest-admitted among equals) running sequence is preempted
     by recompute: its blocks are freed and it goes back to the front of the queue.
While urgent work is about, prompt chunks are sized by workers/scheduler/step_budget.py from the step costs
measured so far (`record_step`): urgent chunks take the full token budget, batch chunks fit the step-time
target. The static policy is the baseline: it admits only into an empty batch and prefills whole prompts.

Prefix caching (`rqbatcher.workers.scheduler.blocks`): an admitted sequence starts from the cached full blocks of its
tokens, counted as computed, and always computes at least its last token (it needs its logits). Embedding inputs
(`Sequence.embed`) neither read nor fill the cache, and end after their last prompt chunk, sampling nothing; a
sequence that takes its prompt's logprobs reads no cached block (it needs every position's logits).
Admission and preemption count only the blocks a sequence newly needs. Full blocks are named in the
cache when they are *scheduled*, so a sequence admitted later in the same step starts from blocks that
an earlier one fills in that step: the model writes every new key and value of a layer before any
sequence attends in that layer, so they are there when read. Prompts that arrive together are admitted
together in FIFO order. A waiting sequence whose next shareable block a running prefill has still to fill waits
for it (workers/scheduler/prefix_in_flight.py), whatever the chunk sizes and arrival order, and that prefill runs at
the waiter's urgency meanwhile: a prefix they share is computed once, by the first.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from rqbatcher.config import EngineConfig
from rqbatcher.service_class import INTERACTIVE
from rqbatcher.workers.scheduler import preemption
from rqbatcher.workers.scheduler.blocks import BlockAllocator, PrefixCacheStats, blocks_needed, chain_block_hashes
from rqbatcher.workers.scheduler.prefix_in_flight import PrefixesInFlight
from rqbatcher.workers.scheduler.sequence import Sequence, SequenceStatus
from rqbatcher.workers.scheduler.step_budget import StepBudget
from rqbatcher.workers.scheduler.step_cost import StepCostModel


@dataclass
class StepPlan:
    """What one step computes: tokens per sequence (in execution order) and who was preempted."""

    num_tokens: dict[Sequence, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    def samples(self, seq: Sequence) -> bool:
        """Whether `seq` samples a token this step: its prompt (and output so far) is then fully computed."""
        return not seq.prefill_only and self.completes(seq)

    def completes(self, seq: Sequence) -> bool:
        """Whether `seq`'s tokens are all computed after this step (an embedding input's last chunk)."""
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
        self.prefix_cache_stats = PrefixCacheStats()
        self.batch_floor = preemption.batch_floor(config.min_batch_share, config.max_num_seqs)
        self.urgency_preemptions: dict[str, int] = {}  # by the preempted sequence's class
        self.fairness_preemptions = 0
        self.prefix_blocks_awaited = 0  # since the start: cached blocks that sequences waited for rather than computed
        self.now = 0.0  # the clock at the latest schedule() (fairness measures its interval on it)
        self.step_cost = StepCostModel()
        self.budget = StepBudget(0.0 if config.policy == "static" else config.step_time_target, self.step_cost)
        self.steps = 0  # schedule() calls that planned work

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_slots(self) -> int:
        return max(0, self.config.max_num_seqs - len(self.running) - len(self.waiting))

    @property
    def urgent_room(self) -> int:
        """More urgent requests that could be taken beyond the free slots, each preempting a batch sequence."""
        if self.config.policy == "static":
            return 0
        return preemption.urgent_room(self.running, self.waiting, self.batch_floor, self.config.max_num_seqs)

    @property
    def fair_room(self) -> int:
        """Interactive requests of a tenant holding no slot that could be taken beyond the free slots (0 or 1),
        each to preempt one sequence of the most-served tenant."""
        if self.config.policy == "static":
            return 0
        return preemption.fair_room(self.running, self.waiting, self.now, self.decode_step_s, self.config.max_num_seqs)

    @property
    def decode_step_s(self) -> float:
        """What a decode step of the running batch costs, as measured so far (0 before any step)."""
        return self.step_cost.predict(0, len(self.running))

    @property
    def batch_deficit(self) -> int:
        """Batch requests to take first: what batch work lacks of its minimum share of the slots."""
        return preemption.batch_deficit(self.running, self.waiting, self.batch_floor)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence from the running batch or the queue and free its blocks. A sequence that has already
        finished only takes the new reason (a stop string found in its last token names the reason)."""
        if seq.is_finished:
            seq.finish_reason = reason
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def update(self, plan: StepPlan, sampled: dict[Sequence, int], now: float | None = None) -> list[Sequence]:
        """Advance the sequences of `plan` after its forward: every one computed its scheduled tokens, and
        each one in `sampled` got its next token at `now`. Return the sequences this finished (EOS, length, and
        the prefill-only sequences whose last chunk this was: they free their slot at once, with no decode step)."""
        now = time.monotonic() if now is None else now
        finished = []
        for seq, n in plan.num_tokens.items():
            seq.num_computed_tokens += n
            if seq.prefill_only and seq.num_uncomputed_tokens == 0 and not seq.is_finished:
                seq.first_token_time = seq.last_token_time = now
                self.finish(seq, "length" if seq.scores_prompt_only else "stop")
                finished.append(seq)
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

    def record_step(self, plan: StepPlan, seconds: float) -> None:
        """What `plan`'s step took, measured: the step-cost model learns from it."""
        decode_rows = sum(1 for n in plan.num_tokens.values() if n == 1)
        self.step_cost.observe(plan.total_tokens - decode_rows, decode_rows, seconds)

    def schedule(self, now: float | None = None) -> StepPlan:
        self.now = time.monotonic() if now is None else now
        static = self.config.policy == "static"
        limit = float("inf") if static else self.config.max_num_batched_tokens
        plan = StepPlan()
        admit = not static or not self.running
        in_flight = PrefixesInFlight(self.allocator.block_size)
        for seq in self.running:
            if seq.num_uncomputed_tokens > 1 and not seq.embed and self.allocator.prefix_caching:
                in_flight.add(seq)
        awaiting = {s: holder for s in self.waiting if in_flight and (holder := self._awaited_holder(s, in_flight))}
        if not static:
            self._preempt_for_urgency(plan, awaiting)
        preempted_for_urgency = len(plan.preempted)

        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        urgent = any(s.urgency[0] < preemption.BATCH_RANK for s in (*self.running, *self.waiting))
        self.budget.begin(self.now, urgent, len(decodes))
        joined = {holder for s, holder in awaiting.items() if s.urgency[0] < preemption.BATCH_RANK}
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        candidates = [s for s in self.waiting if s not in awaiting]
        most_urgent = min((s.urgency[0] for s in candidates), default=None)
        held_up = set(awaiting.values())  # a prefill others wait for is never put off
        later = [s for s in prefills if most_urgent is not None and s.urgency[0] > most_urgent and s not in held_up]
        self._schedule_running(decodes + [s for s in prefills if s not in later], plan, limit, joined)
        urgent_admitted = False  # whether this step starts a priority or interactive sequence

        while admit and len(plan.preempted) == preempted_for_urgency and candidates:
            budget = limit - plan.total_tokens
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            seq = preemption.next_waiting(candidates, self.running, self.batch_floor,
                                          self.config.max_num_seqs - len(self.running))
            candidates.remove(seq)
            if in_flight and self._awaited_holder(seq, in_flight) is not None:
                continue  # a sequence admitted earlier in this step is prefilling its next block
            urgent = seq.urgency[0] < preemption.BATCH_RANK
            if urgent_admitted and not urgent:
                break  # a step that starts more urgent work carries no new prompt of less urgent work: it is short
            shared, n, new = self._first_chunk(seq, min(budget, self.budget.allowance(urgent)))
            if n <= 0 or not self.allocator.can_allocate(new, shared):
                break
            self.waiting.remove(seq)
            self._admit(seq, shared, new)
            plan.num_tokens[seq] = n
            self._cache_full_blocks(seq, n)
            if n > 1:
                self.budget.spend(n, urgent)
            if seq.num_computed_tokens + n < seq.num_tokens and not seq.embed and self.allocator.prefix_caching:
                in_flight.add(seq)
            urgent_admitted = urgent_admitted or urgent
        if not urgent_admitted:
            self._schedule_running(later, plan, limit, joined)  # less urgent prefills take what the waiting left
        if plan:
            self.steps += 1
        return plan

    def _schedule_running(self, seqs: list[Sequence], plan: StepPlan, limit: float, joined: set[Sequence]) -> None:
        """Schedule running sequences in order; a prefill that urgent waiters await (`joined`) runs as urgent."""
        for seq in seqs:
            budget = limit - plan.total_tokens
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = int(min(seq.num_uncomputed_tokens, budget))
            urgent = seq.urgency[0] < preemption.BATCH_RANK or seq in joined
            if n > 1:  # prompt work (a recompute's too) is sized to the step-time target
                n = int(min(n, self.budget.allowance(urgent)))
                if n <= 0:
                    continue
            if self._reserve(seq, n, plan):
                plan.num_tokens[seq] = n
                self._cache_full_blocks(seq, n)
                if n > 1:
                    self.budget.spend(n, urgent)

    def _first_chunk(self, seq: Sequence, budget: float) -> tuple[list[int], int, int]:
        """(the cached blocks `seq` starts from, the tokens it computes first, the fresh blocks they need)."""
        shared = self._cached_prefix(seq)
        computed = len(shared) * self.allocator.block_size
        n = int(min(seq.num_tokens - computed, budget))
        return shared, n, blocks_needed(computed + n, self.allocator.block_size) - len(shared)

    def _preempt_for_urgency(self, plan: StepPlan, awaiting: dict[Sequence, Sequence]) -> None:
        """Before anything is scheduled: preempt less urgent running sequences for the more urgent waiting ones
        that no slot or KV block would admit this step, most urgent first, and a sequence of the most-served
        tenant for an interactive one of a tenant holding no slot, within `scheduler.preemption`'s bounds. Those
        `awaiting` a prefix in flight are not admitted this step: they preempt nobody."""
        if not self.running or not self.waiting:
            return
        slots = self.config.max_num_seqs - len(self.running)
        growth = {s: self.allocator.extra_blocks(s.block_table, s.num_tokens) for s in self.running
                  if s.num_uncomputed_tokens == 1}  # the blocks the running decodes take first
        free_blocks = self.allocator.num_free - sum(growth.values())
        for seq in sorted((s for s in self.waiting if s not in awaiting), key=lambda s: s.urgency):
            shared, _, new = self._first_chunk(seq, self.config.max_num_batched_tokens)
            needed = new + sum(1 for b in shared if self.allocator.ref_count(b) == 0)
            while slots <= 0 or free_blocks < needed:
                victim = preemption.victim_for(seq, self.running, self.batch_floor)
                if victim is not None:
                    self.urgency_preemptions[victim.service_class] = (
                        self.urgency_preemptions.get(victim.service_class, 0) + 1)
                elif seq.service_class == INTERACTIVE:
                    victim = preemption.fairness_victim(seq.tenant, self.running, self.now, self.decode_step_s,
                                                        self.config.max_num_seqs)
                    if victim is not None:
                        victim.fairness_preempted_at = self.now
                        self.fairness_preemptions += 1
                if victim is None:
                    break
                free_blocks += sum(1 for b in victim.block_table if self.allocator.ref_count(b) == 1)
                free_blocks += growth.get(victim, 0)
                self._preempt(victim)
                plan.preempted.append(victim)
                slots += 1
            else:
                slots -= 1
                free_blocks -= needed

    def _admit(self, seq: Sequence, shared: list[int], new: int) -> None:
        """Start `seq` from the cached blocks `shared` (their tokens computed) plus `new` fresh blocks."""
        self.allocator.share(shared)  # first: the fresh blocks must not evict the shared ones
        seq.block_table.extend(shared)
        seq.block_table.extend(self.allocator.allocate(new))
        seq.num_computed_tokens = len(shared) * self.allocator.block_size
        if seq.num_preemptions == 0:  # (a resumed sequence's cached blocks may hold generated tokens too)
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            if self.allocator.prefix_caching and not seq.embed:  # an embedding input never looks
                self.prefix_cache_stats.queries += seq.num_prompt_tokens
                self.prefix_cache_stats.hits += seq.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` can start from."""
        return self.allocator.cached_prefix(self._shareable_hashes(seq))

    def _shareable_hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of the blocks `seq` could start from: at most all but its last token, which must be computed.
        An embedding input starts from none: its pooling needs every token's hidden state; nor does a sequence whose
        prompt's logprobs are taken: they need every position's logits."""
        if not self.allocator.prefix_caching or seq.embed or seq.prompt_logprobs is not None:
            return []
        limit = (seq.num_tokens - 1) // self.allocator.block_size
        chain_block_hashes(seq.token_ids, self.allocator.block_size, seq.block_hashes, limit)
        return seq.block_hashes[:limit]

    def _awaited_holder(self, seq: Sequence, in_flight: PrefixesInFlight) -> Sequence | None:
        """The running sequence prefilling the next block `seq` could start from (then `seq` waits for it), or
        None. The blocks it waits for are counted once, the first time."""
        shareable = self._shareable_hashes(seq)
        cached = len(self.allocator.cached_prefix(shareable))
        holder = in_flight.holder_of(shareable, cached)
        if holder is not None and not seq.awaited_prefix:
            seq.awaited_prefix = True
            self.prefix_blocks_awaited += in_flight.blocks_awaited(shareable, cached, holder)
        return holder

    def _cache_full_blocks(self, seq: Sequence, n: int) -> None:
        """Name in the cache the blocks of `seq` that its `n` tokens of this step fill (an embedding input's
        are not named: it reads none either)."""
        if not self.allocator.prefix_caching or seq.embed:
            return
        size = self.allocator.block_size
        start, end = seq.num_computed_tokens // size, (seq.num_computed_tokens + n) // size
        if end > start:
            chain_block_hashes(seq.token_ids, size, seq.block_hashes, end)
            self.allocator.cache_full_blocks(seq.block_table, seq.block_hashes, start, end)

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Grow `seq`'s blocks for `n` more tokens, preempting the latest admitted until they fit."""
        target = seq.num_computed_tokens + n
        while not self.allocator.can_allocate(self.allocator.extra_blocks(seq.block_table, target)):
            victim = preemption.least_urgent(self.running)
            self._preempt(victim)
            plan.preempted.append(victim)
            plan.num_tokens.pop(victim, None)
            if victim is seq:
                return False
        self.allocator.grow(seq.block_table, target)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV blocks and requeue at the front."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks. Blocks it was to fill in the step being run, but never did (preempted while
        scheduling, or its forward failed), leave the cache; a sequence that started from one of them in
        that step is preempted too, since their keys and values were never written."""
        unfilled = self.allocator.uncache_unfilled(seq.block_table, seq.num_computed_tokens)
        self.allocator.release(seq.block_table)
        for other in [s for s in self.running if not unfilled.isdisjoint(s.block_table)]:
            if other.status is SequenceStatus.RUNNING:  # not already preempted through a sequence it shared with
                self._preempt(other)
