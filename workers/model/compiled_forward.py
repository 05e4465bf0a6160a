"""The model's forward compiled (torch.compile) for small steps: one static graph per token-count bucket.

A decode step of a small model launches thousands of small ops (norms, rotary embeddings, activations)
from Python, and on a CPU that costs as much as reading the weights. Compiled, they fuse into a few
generated kernels and the Python glue goes away.

- Shapes stay static: a step's tokens are padded up to the next bucket (1, 2, 4, ... up to the largest
  step worth compiling), so there are only a few graphs, all compiled at start-up (`compile_buckets`).
  Dynamic shapes were measured to compile slower code that still recompiles.
- Attention (`batcher::paged_attention`) and packed linears (`batcher::packed_linear`) are ops opaque to
  the compiler, so a graph depends on the token count alone, not on block tables or the batch's layout.
  Padding rows get zeros from attention and their logits are dropped.
- Steps longer than the largest bucket (long prefill chunks) run eagerly: their matmuls dominate anyway.
- On CUDA this compiles without CUDA graphs: attention reads each step's metadata outside the graph,
  which a graph replay would freeze.
- Compiling costs start-up time (tens of seconds per bucket on a CPU, less once inductor's cache is
  warm), which is why it is opt-in (`EngineConfig.compile`).
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

BUCKET_GROWTH = 2  # each bucket holds twice the tokens of the one before: padding wastes < half a step


def bucket_sizes(largest: int) -> list[int]:
    """1, 2, 4, ... and `largest` itself: every step of up to `largest` tokens fits one."""
    sizes = [1]
    while sizes[-1] * BUCKET_GROWTH < largest:
        sizes.append(sizes[-1] * BUCKET_GROWTH)
    return sizes if sizes[-1] == largest else [*sizes, largest]


def engine_own_forward(model: torch.nn.Module):
    """`model(**inputs)` behind a code object of its own. Dynamo keeps compiled graphs (and counts
    recompiles) per code object; with every engine's graphs apart, one engine's model can never run
    another's graph (the model's guards are skipped, see below), nor use up its recompile budget."""

    def forward(**inputs):
        return model(**inputs)

    forward.__code__ = forward.__code__.replace()  # an equal code object, but a distinct one
    return forward


class CompiledForward:
    """`model(...)` compiled for steps of up to `largest` tokens; call it with inputs already padded
    to one of `buckets`."""

    def __init__(self, model: torch.nn.Module, largest: int) -> None:
        self.buckets = bucket_sizes(largest)
        # The model never changes once loaded, so the guards on its modules and parameters are skipped:
        # checking them costs ~1 ms a call. Input shapes stay guarded: they pick the bucket's graph.
        self._forward = torch.compile(engine_own_forward(model), fullgraph=True, dynamic=False,
                                      options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds `num_tokens`, or None when the step runs eagerly."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def __call__(self, **inputs):
        return self._forward(**inputs)

    def compile_buckets(self, run_bucket) -> None:
        """Compile every bucket's graph now, by calling `run_bucket(size)` for each (it runs one padded step)."""
        started = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=len(self.buckets)):
            for size in self.buckets:
                run_bucket(size)
        log.info("compiled the forward for steps of %s tokens in %.0f s", self.buckets, time.perf_counter() - started)
