"""Steps sized to a latency target (Sarathi-Serve's idea: the token budget follows from a time target).

While priority or interactive work runs or waits in the engine, or did within QUIET_S, a step's prompt chunks
are cut so that the step's predicted time (`step_cost.StepCostModel`, fitted on the steps measured so far) stays
within `step_time_target`: an urgent request that arrives waits for a short step, not for a long prompt chunk of
batch work. Otherwise, and until the cost is known, the full token budget runs, so batch throughput is untouched;
the first urgent request after a quiet period may then wait for one full step.

Floors keep work moving under any target: batch prompt work gets at least BATCH_PROMPT_FLOOR tokens of every step
that carries any (so batch prefill always progresses), and an urgent prompt chunk at least URGENT_PROMPT_FLOOR. An
urgent prompt longer than the target allows is itself chunked: the one case where a request's time to first token
grows with its own length, and only while other sequences decode: with none decoding, chunking an urgent prompt
protects nobody and doubles its own time to first token (measured through the gateway: 945 against 417 ms for
128 tokens of SmolLM2, fp32, one thread), so it takes the full budget.
"""

from __future__ import annotations

import math

from rqbatcher.workers.scheduler.step_cost import StepCostModel

QUIET_S = 10.0  # how long after the last urgent work the target still binds (a pause between requests)
BATCH_PROMPT_FLOOR = 32  # tokens: two blocks of 16
URGENT_PROMPT_FLOOR = 16


class StepBudget:
    """One step's allowance of prompt tokens under the time target; `begin` it as each step is planned."""

    def __init__(self, target_s: float | None, cost: StepCostModel) -> None:
        self.target_s = target_s
        self.cost = cost
        self.binding = False
        self.prompt_tokens = math.inf  # the step's prompt-token budget as planned at `begin` (a gauge shows it)
        self._last_urgent: float | None = None
        self._left_s = math.inf
        self._batch_floor_left = 0
        self._decode_rows = 0

    def begin(self, now: float, urgent_present: bool, decode_rows: int) -> None:
        if urgent_present:
            self._last_urgent = now
        recent = self._last_urgent is not None and now - self._last_urgent < QUIET_S
        self.binding = bool(self.target_s) and self.cost.ready and recent
        if self.binding:
            self._left_s = self.target_s - self.cost.predict(0, decode_rows)
            self.prompt_tokens = self.cost.prompt_tokens_within(self._left_s)
        else:
            self._left_s = self.prompt_tokens = math.inf
        self._batch_floor_left = BATCH_PROMPT_FLOOR
        self._decode_rows = decode_rows

    def allowance(self, urgent: bool) -> float:
        """How many prompt tokens one chunk may take now (inf when the target does not bind, or for urgent work
        while nothing decodes)."""
        if not self.binding or (urgent and not self._decode_rows):
            return math.inf
        fits = self.cost.prompt_tokens_within(self._left_s)
        return max(fits, URGENT_PROMPT_FLOOR if urgent else self._batch_floor_left)

    def spend(self, tokens: int, urgent: bool) -> None:
        if self.binding:
            self._left_s -= self.cost.prompt_token_s * tokens
            if not urgent:
                self._batch_floor_left = max(0, self._batch_floor_left - tokens)
