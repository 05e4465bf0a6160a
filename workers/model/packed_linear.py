"""Linear layers on CPU on the fastest kernel for their dtype and rows: bf16 weights packed once, at load, for
oneDNN; fp32 decode rows on `rqbatcher.kernels.native`'s AVX2 kernel.

A plain bf16 `F.linear` on CPU hands oneDNN the weight in its plain layout, and oneDNN re-blocks it in
every call: at decode sizes that costs more than the matmul (80 us against 14-21 us for a 576x576 weight
at one row). Packing each weight once (`torch.ops.mkldnn._reorder_linear_weight`) and calling
`mkldnn._linear_pointwise` on it gives the same bits, and a decode step ~1.3x faster
(`/work/shared/notes/cpu-step-overhead.md`, section 4).

The plain weight stays (tied embeddings and state dicts read it), so packing costs one more copy of the
linear weights. A decode step's few rows take `rqbatcher.kernels.native`'s kernels instead where they run, since oneDNN
reads a weight well below the memory's pace at those sizes (about 9 GB/s on an AMX host): one row (a lone
decode) `small_linear` on the plain weight, and 2 to 32 rows `tile_linear` on a third copy of the weight laid
out in AMX's tiles (AMX's products where the CPU has AMX, else AVX-512 BF16's). Both copies are laid end to end
in the order the forward reads the weights.

Batch invariant (`pack_linears(..., batch_invariant=True)`, `EngineConfig.batch_invariant`): every row count
takes `tile_linear`, whose sum for each output runs over K in one order whatever the rows beside it, so a row's
result does not depend on the step it is in (docs/batch-invariance.md). small_linear (one lone dot product per
output, summed across a vector) and oneDNN (its own blocking, by row count) would each sum in another order;
neither runs, and no oneDNN copy of the weights is made.

A packed weight is an opaque oneDNN tensor that torch.compile cannot trace into: inside a compiled forward
each call goes through the op `batcher::packed_linear`, which the compiler leaves alone.

In fp32 (`route_fp32_linears`) nothing is packed: MKL serves many rows well on the plain weight, but reads it
well below the memory's pace at a decode step's few rows on some CPUs, where `native.fp32_linear` takes up to
FP32_LINEAR_MAX_ROWS rows (1.36x at one row, 1.9x at 2-4 on an AMD EPYC). The weights are laid end to end, as
above.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rqbatcher.kernels import native


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing pays for bf16 on a CPU whose oneDNN has native bf16 kernels."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _on_tiles(rows: int, tile_weight: torch.Tensor | None) -> bool:
    return tile_weight is not None and 1 < rows <= native.TILE_MAX_ROWS  # one row: small_linear is faster


def _on_small_linear(rows: int, small_rows: bool) -> bool:
    return small_rows and 0 < rows <= native.LINEAR_MAX_ROWS


def _multiply(x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor | None,
              tile_weight: torch.Tensor | None, small_rows: bool, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + b` by the fastest kernel for x's rows, or, with no oneDNN copy (batch invariant), by tile_linear
    at every row count (see the module's docstring)."""
    rows = x.numel() // weight.shape[1]
    if packed_weight is None or _on_tiles(rows, tile_weight):
        return native.tile_linear(x, tile_weight, bias, weight.shape[0])
    if _on_small_linear(rows, small_rows):
        return native.small_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@torch.library.custom_op("batcher::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed_weight: torch.Tensor | None,
                  tile_weight: torch.Tensor | None, small_rows: bool, bias: torch.Tensor | None) -> torch.Tensor:
    """`_multiply` as an op the compiler leaves alone (it cannot trace a packed weight)."""
    return _multiply(x, weight, packed_weight, tile_weight, small_rows, bias)


@packed_linear.register_fake
def _(x, weight, packed_weight, tile_weight, small_rows, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` that multiplies by its packed weight (`pack_linears` turns a Linear into one), or, for
    few rows, on `rqbatcher.kernels.native`'s kernels: by `tile_weight` (2 or more rows) or by its plain weight
    (`small_rows`). Batch invariant, it has no packed weight (None), and every row count takes `tile_weight`."""

    packed_weight: torch.Tensor | None
    tile_weight: torch.Tensor | None
    small_rows: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = (self.weight, self.packed_weight, self.tile_weight, self.small_rows, self.bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, *weights)
        return _multiply(x, *weights)  # the op's own dispatch costs for nothing here

    def eager(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` for an eager caller (the fused decoder): batch invariant, where every row count takes
        `tile_linear`, that kernel bound to this layer's tile copy (`native.tile_linear_on`: the module's way to it
        cost ~3 us a call, ~120 calls a lone step); else `forward`, which picks a kernel by the rows."""
        if self.packed_weight is not None or self.tile_weight is None:
            return self.forward
        return native.tile_linear_on(self.tile_weight, self.bias, self.out_features)


def pack_linears(model: torch.nn.Module, few_rows_native: bool = False, batch_invariant: bool = False) -> int:
    """Pack the weight of every `nn.Linear` in `model`, in place; returns how many were packed. With
    `few_rows_native` (where `kernels.native` loads), inputs of few rows take its kernels; `batch_invariant` (which
    needs them) sends every row count to `tile_linear` instead, and packs no copy for oneDNN."""
    if batch_invariant and not few_rows_native:
        raise ValueError("batch-invariant linears run on kernels.native's tile_linear: few_rows_native must be set")
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    if not linears:  # packed already (a second engine on the same model)
        return 0
    for module in linears:
        module.packed_weight = (None if batch_invariant
                                else torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None))
        module.tile_weight = native.tile_pack(module.weight.detach()) if few_rows_native else None
        module.small_rows = few_rows_native
        module.__class__ = PackedLinear
    if few_rows_native:
        _lay_end_to_end([module.weight for module in linears], lambda m, view: setattr(m.weight, "data", view),
                        linears)
        _lay_end_to_end([module.tile_weight for module in linears], lambda m, view: setattr(m, "tile_weight", view),
                        linears)
    return len(linears)


class JointLinear:
    """Linears that read one input (a layer's q, k and v projections; gate and up) as one kernel call at a
    decode step's few rows (batch invariant: at every row count). `pack_linears` and `route_fp32_linears` lay
    their weights end to end, and the AMX tile copies too, so those are one matrix already: this views them as
    one, with no copy. Each output is its own dot product in those kernels, so the joint call gives each module's
    bits. At more rows, and where the weights do not lie so, each module runs on its own. Returns one output per
    module (on one call, views of one)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = modules
        self.sizes = [module.out_features for module in modules]
        packed = all(isinstance(module, PackedLinear) and module.small_rows for module in modules)
        self.fp32 = all(isinstance(module, FewRowsLinear) for module in modules)
        self.weight = _one_matrix([module.weight for module in modules]) if packed or self.fp32 else None
        tiles_join = packed and all(module.tile_weight is not None
                                    and module.out_features % native.TILE_COLUMNS == 0 for module in modules)
        self.tile_weight = _one_matrix([module.tile_weight for module in modules]) if tiles_join else None
        self.batch_invariant = packed and all(module.packed_weight is None for module in modules)
        biases = [module.bias for module in modules]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else module.weight.new_zeros(module.out_features)
             for b, module in zip(biases, modules)])

    def eager(self) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        """`__call__` for an eager caller (`PackedLinear.eager`): batch invariant, the joint tile copy's kernel bound
        to it; in fp32, `native.fp32_linear` bound to the joint weight for a decode step's few rows (more rows: this
        object); else this object."""
        sizes = self.sizes
        if self.fp32 and self.weight is not None:
            kernel, features = native.fp32_linear_on(self.weight, self.bias), self.weight.shape[1]

            def few_rows_first(x: torch.Tensor) -> list[torch.Tensor]:
                return kernel(x).split_with_sizes(sizes, -1) if _on_fp32_linear(x.numel() // features) else self(x)
            return few_rows_first
        if self.tile_weight is None or not self.batch_invariant:
            return self
        kernel = native.tile_linear_on(self.tile_weight, self.bias, sum(sizes))
        return lambda x: kernel(x).split_with_sizes(sizes, -1)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        rows = x.numel() // x.shape[-1]
        if self.weight is None:
            return [module(x) for module in self.modules]
        if self.fp32 and _on_fp32_linear(rows):
            return native.fp32_linear(x, self.weight, self.bias).split_with_sizes(self.sizes, -1)
        if self.tile_weight is not None and (self.batch_invariant or _on_tiles(rows, self.tile_weight)):
            y = native.tile_linear(x, self.tile_weight, self.bias, sum(self.sizes))
            return y.split_with_sizes(self.sizes, -1)
        if not self.fp32 and not self.batch_invariant and _on_small_linear(rows, True):
            return native.small_linear(x, self.weight, self.bias).split_with_sizes(self.sizes, -1)
        return [module(x) for module in self.modules]


def _one_matrix(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """`parts` as one tensor, concatenated along their first dimension, where they lie end to end in one
    storage (else None)."""
    first = parts[0]
    for before, after in zip(parts, parts[1:]):
        if (after.shape[1:] != first.shape[1:] or not before.is_contiguous() or not after.is_contiguous()
                or after.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or after.data_ptr() != before.data_ptr() + before.numel() * before.element_size()):
            return None
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def fp32_rows_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fp32 decode rows can take `native.fp32_linear` (`route_fp32_linears`)."""
    return device.type == "cpu" and dtype == torch.float32 and native.load(native.FP32) is not None


def _on_fp32_linear(rows: int) -> bool:
    return 0 < rows <= native.FP32_LINEAR_MAX_ROWS


class FewRowsLinear(torch.nn.Linear):
    """An fp32 `nn.Linear` whose inputs of up to FP32_LINEAR_MAX_ROWS rows take `native.fp32_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _on_fp32_linear(x.numel() // self.in_features) and not torch.compiler.is_compiling():
            return native.fp32_linear(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)  # what a compiled forward traces

    def eager(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` for an eager caller (the fused decoder), its tensors bound: past the module's lookups and the
        compile check, ~2% of a lone fp32 step (0.98x on an Intel Xeon with AMX)."""
        kernel = native.fp32_linear_on(self.weight, self.bias)
        weight, bias, features = self.weight, self.bias, self.in_features

        def few_rows_first(x: torch.Tensor) -> torch.Tensor:
            return kernel(x) if _on_fp32_linear(x.numel() // features) else torch.nn.functional.linear(x, weight, bias)
        return few_rows_first


def route_fp32_linears(model: torch.nn.Module) -> int:
    """Turn every `nn.Linear` of an fp32 `model` into a `FewRowsLinear`, its weights laid end to end in call
    order; returns how many (0 for a model routed already).

    An fp32 checkpoint's weights stay mapped from its file (safetensors), and the layout reads every page of
    them: the other parameters are copied too, so that nothing refers to the mapping any more and those pages
    leave the process (else they stay resident beside the copy: +512 MB for SmolLM2)."""
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    if not linears:
        return 0
    for module in linears:
        module.__class__ = FewRowsLinear
    _lay_end_to_end([module.weight for module in linears], lambda m, view: setattr(m.weight, "data", view), linears)
    laid_out = {id(module.weight) for module in linears}
    for parameter in model.parameters():
        if id(parameter) not in laid_out:
            parameter.data = parameter.data.clone()
    return len(linears)


def _lay_end_to_end(weights: list[torch.Tensor], place, modules: list[torch.nn.Module]) -> None:
    """Move `weights` (one per module) into one buffer, in this order, by `place(module, view)`. A decode step
    then streams one run of memory: a kernel's prefetch at the end of a weight already fetches the next
    (1.16x on SmolLM2's 211 weights at one row). A weight that two modules share (a tied LM head) moves once,
    and stays shared."""
    unique = list({id(w): w for w in weights}.values())
    buffer = torch.empty(sum(w.numel() for w in unique), dtype=unique[0].dtype, device=unique[0].device)
    views, offset = {}, 0
    for weight in unique:
        views[id(weight)] = buffer[offset : offset + weight.numel()].view_as(weight).copy_(weight.detach())
        offset += weight.numel()
    for module, weight in zip(modules, weights):
        place(module, views[id(weight)])
