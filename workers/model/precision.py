"""The floating-point type the engine runs in, and how `--dtype auto` picks it.

`auto` takes the fastest type the device really has: bf16 on a CUDA GPU that supports it (fp16 on one
that does not), and on a CPU whichever of bf16 and fp32 wins a short matmul race at start-up. Many
CPUs have no native bf16 and emulate it, slower than fp32; CPU flags do not say how fast it really
is, so the race decides.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger(__name__)

AUTO = "auto"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The race: a decode-sized batch through a square weight; a fraction of a second in all, at start-up.
PROBE_ROWS = 64
PROBE_SIZE = 1024
PROBE_WARMUP = 3  # oneDNN's first bf16 calls build their kernels: 20-60 ms each, sometimes for a few calls
PROBE_REPEATS = 10
# bf16 costs precision, so it must win clearly; a near tie would flip between runs with the noise.
BF16_MIN_SPEEDUP = 1.2


def resolve_dtype(name: str, device: torch.device) -> str:
    """The dtype to run in: `name` itself, or for `auto` the fastest one `device` has (logged)."""
    if name != AUTO:
        return name
    if device.type == "cuda":
        chosen = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        log.info("dtype auto: %s on %s", chosen, torch.cuda.get_device_name(device))
        return chosen
    if device.type != "cpu":
        log.info("dtype auto: float32 (no probe for %s devices)", device.type)
        return "float32"
    speedup = cpu_bf16_speedup()
    chosen = "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"
    log.info("dtype auto: %s (a bf16 matmul runs %.2fx as fast as fp32 on this CPU; bf16 needs %.1fx)",
             chosen, speedup, BF16_MIN_SPEEDUP)
    return chosen


@functools.cache
def cpu_bf16_speedup() -> float:
    """fp32 time over bf16 time of the same matmul, best of a few interleaved runs (>1: bf16 is faster).
    Measured once per process, at the thread count in force."""
    timings = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    operands = {dtype: (torch.randn(PROBE_ROWS, PROBE_SIZE, dtype=dtype),
                        torch.randn(PROBE_SIZE, PROBE_SIZE, dtype=dtype)) for dtype in timings}
    for a, b in operands.values():
        for _ in range(PROBE_WARMUP):
            torch.mm(a, b)
    for _ in range(PROBE_REPEATS):
        for dtype, (a, b) in operands.items():
            started = time.perf_counter()
            torch.mm(a, b)
            timings[dtype] = min(timings[dtype], time.perf_counter() - started)
    return timings[torch.float32] / timings[torch.bfloat16]
