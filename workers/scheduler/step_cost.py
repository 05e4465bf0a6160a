"""What a step costs, learnt online: seconds ≈ base + per prompt token × prompt tokens + per decode row × rows.

The engine reports every step's measured time (`observe`); the scheduler asks how many prompt tokens fit in
what is left of a step's time target (`prompt_tokens_within`). Three numbers, fitted by least squares over the
recent steps, each older step weighing DECAY times less, so the model follows a device whose speed changes (a
neighbour's load, a clock that drops) within tens of steps. No profile run: until it has seen enough steps with
prompt work (`ready`), the scheduler keeps its full token budget.
"""

from __future__ import annotations

DECAY = 0.95  # weight of a step's observation one step later: the fit spans the last ~20 steps
MIN_PROMPT_STEPS = 3  # steps with prompt work seen before the fit is trusted
# Features are scaled to about 1 at a full step, so one small ridge term steadies every coefficient alike.
PROMPT_SCALE = 512.0
ROW_SCALE = 32.0
RIDGE = 1e-3


class StepCostModel:
    """seconds ≈ base_s + prompt_token_s × prompt tokens + decode_row_s × decode rows, fitted online."""

    def __init__(self) -> None:
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed sums of x xᵀ and x y over the observed steps
        self._xy = [0.0] * 3
        self.prompt_steps = 0
        self.base_s = self.prompt_token_s = self.decode_row_s = 0.0

    @property
    def ready(self) -> bool:
        return self.prompt_steps >= MIN_PROMPT_STEPS and self.prompt_token_s > 0

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        x = (1.0, prompt_tokens / PROMPT_SCALE, decode_rows / ROW_SCALE)
        for i in range(3):
            self._xy[i] = DECAY * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = DECAY * self._xx[i][j] + x[i] * x[j]
        if prompt_tokens:
            self.prompt_steps += 1
        base, per_prompt, per_row = _fit(self._xx, self._xy)
        self.base_s, self.prompt_token_s, self.decode_row_s = base, per_prompt / PROMPT_SCALE, per_row / ROW_SCALE

    def predict(self, prompt_tokens: int, decode_rows: int) -> float:
        return self.base_s + self.prompt_token_s * prompt_tokens + self.decode_row_s * decode_rows

    def prompt_tokens_within(self, seconds: float) -> int:
        """How many more prompt tokens fit in `seconds` of a step."""
        return max(0, int(seconds / self.prompt_token_s)) if self.prompt_token_s > 0 else 0


def _fit(xx: list[list[float]], xy: list[float]) -> tuple[float, float, float]:
    """Ridge least squares, no coefficient below zero (a coefficient the data drives negative is dropped and the
    others refitted)."""
    active = [0, 1, 2]
    while True:
        solution = _solve([[xx[i][j] + (RIDGE if i == j else 0.0) for j in active] for i in active],
                          [xy[i] for i in active])
        negative = [active[k] for k, value in enumerate(solution) if value < 0]
        if not negative:
            coefficients = [0.0, 0.0, 0.0]
            for k, i in enumerate(active):
                coefficients[i] = solution[k]
            return coefficients[0], coefficients[1], coefficients[2]
        active = [i for i in active if i not in negative]
        if not active:
            return 0.0, 0.0, 0.0


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small, positive definite system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
