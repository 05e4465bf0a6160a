"""The roofline of `batcher bench`: the shortest wall time any system could run a workload in, on this device.

Measured in the run's process and dtype: the matmul peak (`report.matmul_probe`) and the memory's read
bandwidth (`read_bandwidth`). From them and the workload, a lower bound on the run's wall time:

- decode steps: every scheduler needs at least as many steps as the longest output, and at least the
  total output divided by the slots; each step reads every weight matrix once (`Roofline.weight_read_s`);
- plus the workload's useful FLOPs (`ModelCost`) at the matmul peak.

Each system's `pct_of_limit` is that bound over its wall time, as a percentage. The batch-1 decode step is
set against the same weight-read time: reading the weights is all a lone sequence's step must do.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batcher.schema import GenerationRequest, SamplingParams
from workers.bench.workload import WorkloadRequest

if TYPE_CHECKING:
    from workers.bench.report import ModelCost

READ_PROBE_BYTES = 512 << 20  # larger than any CPU's last-level cache: the probe reads memory, not cache
READ_PROBE_REPEATS = 5
DECODE_PROBE_STEPS = 12  # decode steps of one lone sequence timed after a batcher run
DECODE_PROBE_PROMPT = [100] * 16
DECODE_PROBE_ID = "decode-probe"


def read_bandwidth(device: str = "cpu") -> float:
    """Bytes per second at which this device streams a matrix from memory, best of a few runs.

    An fp32 matrix-vector product reads its matrix once, as a decode step reads its weights, and MKL's
    (or cuBLAS's) fp32 GEMV streams at the memory's pace; the rate is the memory's, whatever dtype the
    model's weights are in."""
    columns = 4096
    matrix = torch.ones(READ_PROBE_BYTES // (4 * columns), columns, dtype=torch.float32, device=device)
    vector = torch.ones(columns, 1, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(READ_PROBE_REPEATS + 1):
        started = time.perf_counter()
        (matrix @ vector).sum().item()  # .item() waits for the device
        best = min(best, time.perf_counter() - started)
    return READ_PROBE_BYTES / best


@dataclass(frozen=True)
class Roofline:
    matmul_flop_s: float  # the matmul probe, in the run's dtype
    read_bytes_s: float  # `read_bandwidth`
    weight_bytes: int  # every weight matrix one decode step reads: the layers' and the LM head's
    slots: int
    decode_steps: int  # at least the longest output, and at least the total output over the slots
    workload_flops: int  # the workload's useful FLOPs (every request generates exactly max_tokens)
    weight_read_s: float  # the floor of one decode step: reading every weight once
    limit_s: float  # the lower bound on any system's wall time for the workload

    @classmethod
    def of(cls, workload: list[WorkloadRequest], cost: ModelCost, dtype: torch.dtype, slots: int,
           matmul_flop_s: float, read_bytes_s: float) -> Roofline:
        steps = max(max(w.max_tokens for w in workload), math.ceil(sum(w.max_tokens for w in workload) / slots))
        flops = sum(cost.request_flops(w.prompt_len, w.max_tokens) for w in workload)
        weight_bytes = (cost.matmul_params + cost.head_params) * dtype.itemsize
        weight_read_s = weight_bytes / read_bytes_s
        return cls(matmul_flop_s, read_bytes_s, weight_bytes, slots, steps, flops, weight_read_s,
                   steps * weight_read_s + flops / matmul_flop_s)

    def pct_of_limit(self, wall_s: float) -> float:
        return 100 * self.limit_s / wall_s

    def describe(self) -> str:
        return (f"roofline limit {self.limit_s:.3g} s = {self.decode_steps} decode steps x "
                f"{self.weight_read_s * 1e3:.3g} ms weight read ({self.weight_bytes / 1e6:.3g} MB at "
                f"{self.read_bytes_s / 1e9:.3g} GB/s) + {self.workload_flops / 1e12:.3g} TFLOP at "
                f"{self.matmul_flop_s / 1e9:.3g} GFLOP/s")


def lone_decode_step_s(engine) -> float:
    """Median time of a decode step with one sequence in the engine (the engine must be idle)."""
    engine.add(DECODE_PROBE_ID, GenerationRequest(
        prompt_token_ids=DECODE_PROBE_PROMPT, sampling=SamplingParams(max_tokens=DECODE_PROBE_STEPS + 1,
                                                                       ignore_eos=True)))
    times = []
    while engine.has_work():
        started = time.perf_counter()
        engine.step()
        if engine.last_step.num_prefill_tokens == 0:
            times.append(time.perf_counter() - started)
    return statistics.median(times)
