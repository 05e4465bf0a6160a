"""bf16 linear layers on CPU with their weights packed once, at load, for oneDNN.

A plain bf16 `F.linear` on CPU hands oneDNN the weight in its plain layout, and oneDNN re-blocks it in
every call: at decode sizes that costs more than the matmul (80 us against 14-21 us for a 576x576 weight
at one row). Packing each weight once (`torch.ops.mkldnn._reorder_linear_weight`) and calling
`mkldnn._linear_pointwise` on it gives the same bits, and a decode step ~1.3x faster
(`/work/shared/notes/cpu-step-overhead.md`, section 4).

The plain weight stays (tied embeddings and state dicts read it), so packing costs one more copy of the
linear weights. A packed weight is an opaque oneDNN tensor that torch.compile cannot trace into: inside a
compiled forward each call goes through the op `batcher::packed_linear`, which the compiler leaves alone.
"""

from __future__ import annotations

import torch


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing pays for bf16 on a CPU whose oneDNN has native bf16 kernels."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@torch.library.custom_op("batcher::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """`x @ W.T + b` with W packed by oneDNN; `out_features` gives the compiler the output's shape."""
    return _linear(x, packed_weight, bias)


@packed_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` that multiplies by its packed weight (`pack_linears` turns a Linear into one)."""

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed_weight, self.bias, self.out_features)
        return _linear(x, self.packed_weight, self.bias)  # the op's own dispatch costs for nothing here


def pack_linears(model: torch.nn.Module) -> int:
    """Pack the weight of every `nn.Linear` in `model`, in place; returns how many were packed."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            module.__class__ = PackedLinear
            count += 1
    return count
