"""Which attention backend a worker runs (`--attention-backend auto|torch|triton|cpu`), and why not another.

`torch` (kernels.attention) runs anywhere and is the reference. `triton` (kernels.triton_attention) is
one launch per layer per step, for CUDA; on a CPU it runs only under the Triton interpreter, which is how
the tests check it. `cpu` is `torch` with decodes on the decode kernel of `rqbatcher.kernels.native` (one call per layer
reads every decode's keys from the paged cache: bf16 on AVX-512 BF16, fp32 on AVX2) and, in
bf16, prompt chunks on its prefill kernel (AMX where the CPU has it). `auto` takes triton on CUDA, cpu where
its kernels serve the model, and torch elsewhere. FlashInfer or flash-attn could be further backends through
their paged-KV APIs; none is offered yet.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from rqbatcher.config import ATTENTION_AUTO, ATTENTION_CPU, ATTENTION_TORCH, ATTENTION_TRITON
from rqbatcher.errors import BatcherError

log = logging.getLogger(__name__)

INTERPRET_ENV = "TRITON_INTERPRET"


class AttentionBackendError(BatcherError, ValueError):
    """An attention backend that cannot run here, with what to do instead."""


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (read by triton when a kernel is defined)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def resolve_attention_backend(name: str, device: torch.device, why_not_cpu: str | None) -> str:
    """The backend to run: `name`, or for `auto` triton on a CUDA device that has it, cpu where its kernel
    serves the model (`why_not_cpu` is None: `rqbatcher.kernels.native.why_not`), and torch elsewhere. An explicit
    backend that cannot run here is refused with the reason."""
    triton_installed = importlib.util.find_spec("triton") is not None
    if name == ATTENTION_AUTO:
        if device.type == "cuda" and triton_installed:
            chosen, note = ATTENTION_TRITON, ""
        elif why_not_cpu is None:
            chosen, note = ATTENTION_CPU, ""
        else:
            chosen = ATTENTION_TORCH
            note = " (triton is not installed)" if device.type == "cuda" else f" (no CPU kernel: {why_not_cpu})"
        log.info("attention backend auto: %s on %s%s", chosen, device.type, note)
        return chosen
    if name == ATTENTION_CPU:
        if why_not_cpu is not None:
            raise AttentionBackendError(f"--attention-backend cpu cannot run here: {why_not_cpu}; "
                                        "use --attention-backend torch")
        return ATTENTION_CPU
    if name != ATTENTION_TRITON:
        return name
    if not triton_installed:
        raise AttentionBackendError("--attention-backend triton needs triton: pip install triton")
    if device.type == "cpu" and not interpreting():
        raise AttentionBackendError(f"--attention-backend triton runs on a CPU only under {INTERPRET_ENV}=1 "
                                    "(an interpreter, for tests: slow); use --attention-backend torch on a CPU")
    if device.type not in ("cpu", "cuda"):
        raise AttentionBackendError(f"--attention-backend triton runs on CUDA devices, not {device.type}")
    return ATTENTION_TRITON
