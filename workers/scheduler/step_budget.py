"""Each step's prompt budget: from what waits and what decodes, and from measured step costs (step_cost.py).

While priority or interactive work runs or waits in the engine, or did within QUIET_S:
- Urgent prompt work is never starved. Each step may always give it the *efficient chunk*: the fewest tokens
  whose prompt time is EFFICIENT_PROMPT_SHARE of its step (the rest being the step's fixed cost, base and decode
  rows), so chunking grows a request's own time to first token by at most 1 / EFFICIENT_PROMPT_SHARE whatever the
  target. With nothing decoding, chunking protects nobody: it takes the full budget.
- The step-time target protects arrivals and decoders from batch prompt work only: batch chunks fill what is left
  of the target after the decodes and the urgent chunks, and keep BATCH_PROMPT_FLOOR tokens of any step that
  carries some, so batch prefill always progresses.
- The target is `step_time_target` when given (0 turns it off); by default, and wherever the given one is below
  what the decodes alone cost (infeasible: `infeasible` says so), it is TARGET_DECODE_MULTIPLE times the
  decode-only step the cost model predicts: batch prefill at most doubles the decoders' inter-token latency, on a
  slow CPU as on a fast GPU.
Otherwise, and until the cost model is ready, the full token budget runs, so batch throughput is untouched.
"""

from __future__ import annotations

import math

from rqbatcher.workers.scheduler.step_cost import StepCostModel

QUIET_S = 10.0  # how long after the last urgent work the target still binds (a pause between requests)
BATCH_PROMPT_FLOOR = 32  # tokens: two blocks of 16
EFFICIENT_PROMPT_SHARE = 0.9  # of an urgent chunk's step spent on its prompt: its TTFT grows at most 1.11x
TARGET_DECODE_MULTIPLE = 2.0  # the measured target, in decode-only steps: batch prefill may take as long as decodes


class StepBudget:
    """One step's allowance of prompt tokens; `begin` it as each step is planned, `spend` what each chunk takes.

    `target_s` None: the measured target; 0: none."""

    def __init__(self, target_s: float | None, cost: StepCostModel) -> None:
        self.target_s = target_s
        self.cost = cost
        self.binding = False
        self.infeasible = False  # the given target is below what the step's decodes alone cost: the measured one runs
        self.step_target_s = 0.0  # the target the step is planned to (0: none binds)
        self.prompt_tokens = math.inf  # the batch prompt tokens the step could take as planned at `begin` (a gauge)
        self.urgent_tokens = self.batch_tokens = 0  # prompt tokens given to urgent and to batch work this step
        self._last_urgent: float | None = None
        self._left_s = math.inf
        self._efficient_chunk = 0
        self._decode_rows = 0

    def begin(self, now: float, urgent_present: bool, decode_rows: int) -> None:
        if urgent_present:
            self._last_urgent = now
        recent = self._last_urgent is not None and now - self._last_urgent < QUIET_S
        self.binding = self.target_s != 0 and self.cost.ready and recent
        self.urgent_tokens = self.batch_tokens = 0
        self._decode_rows = decode_rows
        self.infeasible = False
        if not self.binding:
            self._left_s = self.prompt_tokens = math.inf
            self.step_target_s = 0.0
            return
        decode_only_s = self.cost.predict(0, decode_rows)
        self.infeasible = self.target_s is not None and self.target_s <= decode_only_s
        measured = self.target_s is None or self.infeasible
        self.step_target_s = TARGET_DECODE_MULTIPLE * decode_only_s if measured else self.target_s
        self._left_s = self.step_target_s - decode_only_s
        self.prompt_tokens = max(BATCH_PROMPT_FLOOR, self.cost.prompt_tokens_within(self._left_s))
        fixed_s = decode_only_s * EFFICIENT_PROMPT_SHARE / (1 - EFFICIENT_PROMPT_SHARE)
        self._efficient_chunk = max(BATCH_PROMPT_FLOOR, self.cost.prompt_tokens_within(fixed_s))

    def allowance(self, urgent: bool) -> float:
        """How many prompt tokens one chunk may take now (inf when nothing binds, or for urgent work while nothing
        decodes)."""
        if not self.binding or (urgent and not self._decode_rows):
            return math.inf
        fits = self.cost.prompt_tokens_within(self._left_s)
        if urgent:
            return max(fits, self._efficient_chunk - self.urgent_tokens)
        return max(fits, BATCH_PROMPT_FLOOR - self.batch_tokens)

    def spend(self, tokens: int, urgent: bool) -> None:
        if urgent:
            self.urgent_tokens += tokens
        else:
            self.batch_tokens += tokens
        if self.binding:
            self._left_s -= self.cost.prompt_token_s * tokens
