"""The roofline of `python -m benchmarks.compare`: the shortest wall time any system could run a workload in, on
this device.

Measured in the run's process and dtype: the matmul peak (`matmul_probe`) and the memory's read
bandwidth (`read_bandwidth`). From them and the workload, a lower bound on the run's wall time:

- decode steps: every scheduler needs at least as many steps as the longest output, and at least the
  total output divided by the slots; each step reads every weight matrix once (`Roofline.weight_read_s`);
- each decode token reads its sequence's keys and values from the KV cache, at the memory's pace (a decode's
  attention does ~3 FLOPs per byte it reads: memory, not the matmul peak, bounds it), except the keys of a
  prefix it shares with another request, which a perfect system could read once for all of them;
- plus the workload's other useful FLOPs (`ModelCost`) at the matmul peak, without the shared prefixes a
  perfect prefix cache would skip (`shared_prefix_lengths`).

Each system's `pct_of_limit` is that bound over its wall time, as a percentage. The batch-1 decode step is
set against the same weight-read time: reading the weights is all a lone sequence's step must do.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.bench.workload import WorkloadRequest, shared_prefix_lengths
from rqbatcher.workers.model.int8_linear import Int8Linear

PROBE_SIZE = 1024  # square matmul in the run's dtype: large enough to run at the CPU's peak, yet ~5-30 ms
PROBE_REPEATS = 10
READ_PROBE_BYTES = 512 << 20  # larger than any CPU's last-level cache: the probe reads memory, not cache
READ_PROBE_REPEATS = 5
DECODE_PROBE_STEPS = 12  # decode steps of one lone sequence timed after a batcher run
DECODE_PROBE_PROMPT = [100] * 16
DECODE_PROBE_ID = "decode-probe"
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")  # Linux: one index* folder per cache of the first core
SIZE_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


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


def matmul_probe(dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    """The best FLOP/s of a square matmul here and now: the ceiling the model's matmuls could reach."""
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, dtype=dtype, device=device)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(PROBE_REPEATS + 1):
        started = time.perf_counter()
        (a @ b).sum().item()  # .item() waits for the device
        best = min(best, time.perf_counter() - started)
    return 2 * PROBE_SIZE**3 / best


@dataclass(frozen=True)
class ModelCost:
    """FLOPs of one token: weights (2 per multiply-add) plus attention over its context; and the cache it reads."""

    matmul_params: int  # every weight matrix a token goes through, except the embeddings and the LM head
    head_params: int  # the LM head, which runs only on tokens that sample
    attention_flops_per_key: int  # QK^T and PV over all layers, per key in the context
    kv_values_per_key: int  # a key's keys and values in the cache, over all layers
    weight_bytes: int  # what those matrices and the head are stored in (int8 weights: a byte each, and their scales)

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelCost:
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        head = model.get_output_embeddings()
        matrices = [p for p in model.parameters()
                    if p.dim() == 2 and id(p) not in embeddings and p is not getattr(head, "weight", None)]
        quantized = [m for m in model.modules() if isinstance(m, Int8Linear) and m is not head]
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(matmul_params=sum(p.numel() for p in matrices) + sum(_params(m) for m in quantized),
                   head_params=_params(head), attention_flops_per_key=4 * config.num_hidden_layers * heads * head_dim,
                   kv_values_per_key=2 * config.num_hidden_layers * kv_heads * head_dim,
                   weight_bytes=sum(_nbytes(p) for p in matrices) + sum(map(_stored_bytes, [*quantized, head])))

    def request_flops(self, prompt_len: int, generated: int, cached: int = 0) -> int:
        """A request's useful FLOPs: every token but the last one is fed through the model once, except the
        first `cached`, whose keys and values came from the prefix cache."""
        fed = prompt_len + generated - 1
        keys = fed * (fed + 1) // 2 - cached * (cached + 1) // 2  # token i attends to i + 1 keys
        return (2 * self.matmul_params * (fed - cached) + 2 * self.head_params * generated
                + self.attention_flops_per_key * keys)

    def decode_keys(self, prompt_len: int, generated: int, shared: int = 0) -> int:
        """Keys that a request's decode tokens (every generated token but the last is fed back) read from the
        cache, without the `shared` first ones of a prefix that other requests read too: decode token j
        (counting the prompt's) attends to j + 1 keys."""
        decodes = max(0, generated - 1)
        first, last = prompt_len + 1, prompt_len + decodes
        return (first + last) * decodes // 2 - shared * decodes


@dataclass(frozen=True)
class Roofline:
    matmul_flop_s: float  # the matmul probe, in the run's dtype
    read_bytes_s: float  # `read_bandwidth`
    weight_bytes: int  # every weight matrix one decode step reads: the layers' and the LM head's
    slots: int
    decode_steps: int  # at least the longest output, and at least the total output over the slots
    workload_flops: int  # the workload's useful FLOPs (every request generates exactly max_tokens)
    kv_read_bytes: int  # what the decode tokens read from the KV cache, shared prefixes once
    weight_read_s: float  # the floor of one decode step: reading every weight once
    limit_s: float  # the lower bound on any system's wall time for the workload

    @classmethod
    def of(cls, workload: list[WorkloadRequest], cost: ModelCost, dtype: torch.dtype, slots: int,
           matmul_flop_s: float, read_bytes_s: float) -> Roofline:
        steps = max(max(w.max_tokens for w in workload), math.ceil(sum(w.max_tokens for w in workload) / slots))
        shared = shared_prefix_lengths(workload)
        flops = sum(cost.request_flops(w.prompt_len, w.max_tokens, shared[w.id]) for w in workload)
        decode_keys = sum(cost.decode_keys(w.prompt_len, w.max_tokens, shared[w.id]) for w in workload)
        decode_attention_flops = cost.attention_flops_per_key * decode_keys
        kv_read_bytes = cost.kv_values_per_key * dtype.itemsize * decode_keys
        weight_read_s = cost.weight_bytes / read_bytes_s
        decode_attention_s = max(kv_read_bytes / read_bytes_s, decode_attention_flops / matmul_flop_s)
        return cls(matmul_flop_s, read_bytes_s, cost.weight_bytes, slots, steps, flops, kv_read_bytes, weight_read_s,
                   steps * weight_read_s + decode_attention_s + (flops - decode_attention_flops) / matmul_flop_s)

    def pct_of_limit(self, wall_s: float) -> float:
        return 100 * self.limit_s / wall_s

    def describe(self) -> str:
        return (f"roofline limit {self.limit_s:.3g} s = {self.decode_steps} decode steps x "
                f"{self.weight_read_s * 1e3:.3g} ms weight read ({self.weight_bytes / 1e6:.3g} MB at "
                f"{self.read_bytes_s / 1e9:.3g} GB/s) + decodes' KV reads ({self.kv_read_bytes / 1e9:.3g} GB) + "
                f"{self.workload_flops / 1e12:.3g} TFLOP at {self.matmul_flop_s / 1e9:.3g} GFLOP/s (decode attention "
                f"at the larger of its reads' time and its FLOPs')")


def _params(linear: torch.nn.Module) -> int:
    """Weights of a linear, float or int8."""
    return linear.in_features * linear.out_features if isinstance(linear, Int8Linear) else linear.weight.numel()


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _stored_bytes(linear: torch.nn.Module) -> int:
    """The bytes a decode step reads for a linear's weight: int8 ones with their scales."""
    if isinstance(linear, Int8Linear):
        return _nbytes(linear.qweight) + _nbytes(linear.wscale)
    return _nbytes(linear.weight)


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The size of the CPU's largest-level cache as Linux reports it, or None where it does not."""
    found = []
    for index in caches.glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            found.append((level, int(size.rstrip("KMG")) * SIZE_SUFFIXES.get(size[-1:], 1)))
        except (OSError, ValueError):
            continue
    return max(found)[1] if found else None


def cache_note(weight_bytes: int, cache_bytes: int | None) -> str | None:
    """A warning where the weights fit in the last-level cache: a step may then read part of them from the cache,
    faster than the memory, and run under the weight-read floor (seen on an Intel Xeon with 300 MB of L3)."""
    if cache_bytes is None or weight_bytes > cache_bytes:
        return None
    return (f"the weights ({weight_bytes / 1e6:.0f} MB) fit in this CPU's last-level cache ({cache_bytes / 1e6:.0f} "
            "MB): a step may read part of them from the cache, so it can run under its weight-read floor")


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
