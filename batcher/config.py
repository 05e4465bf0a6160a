"""The engine's settings, in one dataclass (pure Python, so the CLI can build it without torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DEFAULT_MODEL = "smollm2"
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_DTYPE = "auto"  # the fastest dtype the device has, measured at start-up (rqbatcher.workers.model.precision)
DEFAULT_DEVICE = "auto"
DEFAULT_PREFIX_CACHING = True  # as in vLLM: at a 0% hit rate it costs a hash per filled block
# bf16 on our CPU kernels: a request's tokens do not depend on what else runs (docs/batch-invariance.md)
DEFAULT_BATCH_INVARIANT = True
ATTENTION_AUTO, ATTENTION_TORCH, ATTENTION_TRITON, ATTENTION_CPU = "auto", "torch", "triton", "cpu"
ATTENTION_BACKENDS = (ATTENTION_AUTO, ATTENTION_TORCH, ATTENTION_TRITON, ATTENTION_CPU)
DEFAULT_ATTENTION_BACKEND = ATTENTION_AUTO  # triton on CUDA, cpu for bf16 on an AVX-512 BF16 CPU, else torch
# While urgent work is about, batch prompt work is cut to a step-time target (workers/scheduler/step_budget.py).
# None: measured on the machine, a multiple of the decode-only step its cost model predicts; a number overrides it
# (seconds; 0: none).
DEFAULT_STEP_TIME_TARGET_S = None
DEFAULT_MIN_BATCH_SHARE = 0.25  # of the slots, kept by batch work under any load of more urgent work
DEFAULT_METRICS_ADDR = "127.0.0.1"  # /metrics has no authentication: other hosts reach it only when asked

TASK_GENERATE, TASK_EMBED = "generate", "embed"
TASKS = (TASK_GENERATE, TASK_EMBED)  # what a worker serves: generated text, and embeddings (prefill-only jobs)

Policy = Literal["continuous", "static"]
POLICIES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The weights of the decoder's linears and the LM head: the model's dtype, or int8 per output channel with
# activations quantized per block at each call (rqbatcher.workers.model.int8_linear); attention and the KV cache
# keep the dtype either way.
QUANTIZATION_NONE, QUANTIZATION_INT8 = "none", "int8"
QUANTIZATIONS = (QUANTIZATION_NONE, QUANTIZATION_INT8)
DEFAULT_QUANTIZATION = QUANTIZATION_NONE


@dataclass
class EngineConfig:
    """Every knob of the engine. `num_blocks` wins over `kv_cache_bytes` when both are given."""

    model: str = DEFAULT_MODEL
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_model_len: int | None = None
    dtype: str = DEFAULT_DTYPE
    quantization: str = DEFAULT_QUANTIZATION  # of QUANTIZATIONS
    device: str = DEFAULT_DEVICE
    policy: Policy = "continuous"
    compile: bool = False  # torch.compile the forward of small steps: faster steps, a slower start
    prefix_caching: bool = DEFAULT_PREFIX_CACHING
    batch_invariant: bool = DEFAULT_BATCH_INVARIANT  # bf16 on a CPU where rqbatcher.kernels.native runs; fp32 always is
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    min_batch_share: float = DEFAULT_MIN_BATCH_SHARE
    step_time_target: float | None = DEFAULT_STEP_TIME_TARGET_S  # seconds; None: measured; 0 turns it off
    tasks: tuple[str, ...] = ()  # of TASKS; empty: the model's nature (embedding model: embed, causal LM: generate)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not 0.0 <= self.min_batch_share <= 1.0:
            raise ValueError(f"min_batch_share is a fraction of the slots, 0 to 1, got {self.min_batch_share}")
        if self.step_time_target is not None and self.step_time_target < 0:
            raise ValueError(f"step_time_target is in seconds, 0 or more, got {self.step_time_target}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if unknown := [t for t in self.tasks if t not in TASKS]:
            raise ValueError(f"tasks are {', '.join(TASKS)}, got {', '.join(map(repr, unknown))}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
