"""Each step's prompt budget: from what waits and what decodes, and from measured step costs (step_cost.py).

While priority or interactive work runs or waits in the engine, or did within QUIET_S:
- Urgent prompt work is never throttled: it takes the step's full token budget, as with no target. Cutting it
  would grow the request's own time to first token to shave other urgent requests' inter-token latency, and a
  pool that serves only interactive work (the commonest) would lose throughput and prefix reuse for nothing.
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

    def begin(self, now: float, urgent_present: bool, decode_rows: int) -> None:
        if urgent_present:
            self._last_urgent = now
        recent = self._last_urgent is not None and now - self._last_urgent < QUIET_S
        self.binding = self.target_s != 0 and self.cost.ready and recent
        self.urgent_tokens = self.batch_tokens = 0
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

    def allowance(self, urgent: bool) -> float:
        """How many prompt tokens one chunk may take now: inf for urgent work, or when nothing binds."""
        if urgent or not self.binding:
            return math.inf
        return max(self.cost.prompt_tokens_within(self._left_s), BATCH_PROMPT_FLOOR - self.batch_tokens)

    def spend(self, tokens: int, urgent: bool) -> None:
        if urgent:
            self.urgent_tokens += tokens
        else:
            self.batch_tokens += tokens
        if self.binding:
            self._left_s -= self.cost.prompt_token_s * tokens
