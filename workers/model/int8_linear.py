"""Linear layers on int8 weights (`EngineConfig.quantization == "int8"`): a quarter of fp32's bytes to stream.

A decode step reads every weight once for a few rows of arithmetic, so on a CPU its floor is the weights' bytes
over the memory's bandwidth: 1-byte weights lower it about 4x against fp32 (2x against bf16), and the model's
memory drops with them (no float copy of a quantized weight is kept). Only the linears of the decoder layers and
the LM head are quantized (`quantize_linears`); the embedding table, the norms, attention and the KV cache stay in
the model's dtype.

The arithmetic, which `rqbatcher.kernels.native`'s int8 kernel (`native.int8_linear`, build `native.INT8`) implements
as well, and `int8_linear_reference` in torch (the reference, and what runs where that kernel does not):
- both operands rotated along K (`rotate`): zeros to whole blocks of ROTATION (64), in each block fixed signs
  flipped, then the Hadamard transform's butterflies. The rotation is sqrt(64) times an orthogonal map, so the
  rotated operands' dot products are 64 times the originals'; it spreads a few large activations over their block,
  so that one scale per row fits every block of x (SmolLM2: +0.46% perplexity against +0.78% for x in blocks of 32
  with a scale each, docs/benchmark-log.md), and the kernel's sums need no scaling per block;
- weights symmetric per output channel, quantized once at load from the model's weights (in its dtype) widened to
  float32 and rotated, divided by 64 (`W'`): `wscale[n] = clip[n] / 127`, `qweight[n, k] = round_half_even(W'[n, k]
  * (127 / clip[n]))` clamped to [-127, 127], where `clip[n]` is the fraction of max_k |W'[n, k]| (1 down to 0.76)
  of least squared error (a zero row: scale 0, all 0);
- activations per row, rotated in float32 at every call (`x'`): `sx[r] = amax / 127`, `qx = round(x' * (127 /
  amax))` with `amax = max |x'[r]|` (below TINY, where 127 / amax would overflow float32: scale 0, all 0; a NaN or
  an infinity: the row's outputs NaN);
- `y[r, n] = float(sum_k qx[r, k] * qweight[n, k]) * sx[r] * wscale[n] + bias[n]`, each operation rounded in float32,
  the integer sum exact (int32 in the kernel, float64 in the reference: any order gives the same integer), so both
  give the same bits.
A row's output does not depend on the rows beside it (batch invariance), nor on the columns computed with it, so q,
k and v (gate and up) can run as one call on one matrix (`joint_linear`, for the fused decoder). Where the kernel
runs, a layer keeps its int8 weight only in the kernel's layout (`native.int8_pack`: 16 outputs' bytes side by side).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.pytorch_utils import Conv1D

from rqbatcher.kernels import native
from rqbatcher.workers.model.huge_pages import huge_page_buffer
from rqbatcher.workers.model.packed_linear import JointLinear

QUANT_MAX = 127  # symmetric: -127..127, never -128
ROTATION = native.INT8_ROTATION  # the block along K that x and W are rotated in (`rotate`)
# its signs (`native.INT8_SIGNS`: bit i set, value i of a block negated), as float32 +-1
SIGNS = torch.tensor([-1.0 if native.INT8_SIGNS >> i & 1 else 1.0 for i in range(ROTATION)])
# The least max |value| that a rotated row of x or a weight row keeps (below: all 0), the kernel's: a smaller max
# overflowed 127 / max (x * inf: NaN at a zero, so a row of subnormals came out NaN)
TINY = native.INT8_TINY
CLIP_RATIOS = tuple(1.0 - 0.01 * i for i in range(25))  # of a weight row's max |w|, tried for its clip
# float32 values of a weight quantized at once (1 MB): the clip search's temporaries stay in L2 and reuse their memory,
# where chunks of 4,096 rows faulted in fresh pages at every operation (a 4,096 x 14,336 weight 8-9x the time)
WEIGHT_CHUNK_ELEMENTS = 1 << 18
CHUNK_ELEMENTS = 1 << 22  # of the reference's float64 sums [rows, columns] at once (32 MB)
COLUMN_CHUNK = 8192  # output columns the reference widens to float at once (an LM head has ~50k-150k)


def native_int8(device: torch.device) -> bool:
    """Whether `rqbatcher.kernels.native`'s int8 kernel runs linears on `device` here."""
    return device.type == "cpu" and native.load(native.INT8) is not None


def _scale_and_quantize(values: torch.Tensor, clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization along the last dim of float32 `values`, to `clip` (default: the max |value|): (the
    integers as float32, the scales)."""
    clip = values.abs().amax(dim=-1) if clip is None else clip
    # 127 / clip as one float32 division, as the native kernel computes it (torch's `127 / clip` would be
    # `clip.reciprocal() * 127`, rounded twice)
    inverse = torch.where(clip >= TINY, torch.full_like(clip, QUANT_MAX) / clip, 0.0)
    quantized = torch.round(values * inverse.unsqueeze(-1)).clamp_(-QUANT_MAX, QUANT_MAX)
    return quantized, torch.where(clip < TINY, 0.0, clip / QUANT_MAX)  # NaN stays NaN


def quantize_weight(weight: torch.Tensor, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(`qweight` int8 [N, K] contiguous, `wscale` float32 [N]) of `weight [N, K]`, per output channel, each row
    clipped where its squared error is least (`weight_clip`); a few rows at a time, widened to float32 apart. With
    `rotated`, of the rows as `rotate` turns them (K then whole blocks of ROTATION): what the layers keep."""
    qweight, wscale = [], []
    for rows in weight.detach().split(max(1, WEIGHT_CHUNK_ELEMENTS // weight.shape[1])):
        rows = rotate(rows.float()) / ROTATION if rotated else rows.float()
        quantized, scale = _scale_and_quantize(rows, weight_clip(rows))
        qweight.append(quantized.to(torch.int8))
        wscale.append(scale)
    return torch.cat(qweight), torch.cat(wscale)


def weight_clip(rows: torch.Tensor) -> torch.Tensor:
    """Each row's clip, of CLIP_RATIOS times its max |w|, the one of least squared quantization error: a few large
    weights no longer stretch the step of all the others (on SmolLM2 it halves int8's perplexity cost)."""
    amax = rows.abs().amax(dim=-1)
    best, best_error = amax, None
    for ratio in CLIP_RATIOS:
        clip = amax * ratio
        quantized, scale = _scale_and_quantize(rows, clip)
        error = (quantized * scale.unsqueeze(-1) - rows).square().sum(dim=-1)
        if best_error is None:
            best_error = error
            continue
        better = error < best_error
        best, best_error = torch.where(better, clip, best), torch.where(better, error, best_error)
    return best


def rotate(values: torch.Tensor) -> torch.Tensor:
    """float32 `values [R, K]` rotated along K, as the native kernel rotates x: zeros to whole blocks of ROTATION,
    then in each block the signs flipped (SIGNS) and the Hadamard transform's butterflies (values i and i + h
    become their sum and difference, for h = 1, 2, 4 ... in turn): sqrt(ROTATION) times an orthogonal map, so
    `rotate(x) . rotate(w) / ROTATION` is x . w (`quantize_weight` divides). Returns `[R, K']`, K' the whole blocks."""
    rows, columns = values.shape
    padded = torch.nn.functional.pad(values, (0, -columns % ROTATION))
    count = padded.shape[1] // ROTATION
    blocks = padded.view(rows, count, ROTATION) * SIGNS.to(values.device)
    span = 1
    while span < ROTATION:
        pairs = blocks.view(rows, count, ROTATION // (2 * span), 2, span)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        blocks = torch.stack((first + second, first - second), dim=-2)
        span *= 2
    return blocks.reshape(rows, count * ROTATION)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`qx` float32 [M, K'] of integers, `sx` float32 [M]) of float32 `x [M, K]`: rotated, then one scale a row."""
    return _scale_and_quantize(rotate(x))


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """`y [M, N]` float32 of float32 `x [M, K]` by the arithmetic in the module's docstring, in torch."""
    rows, columns = x.shape[0], qweight.shape[0]
    qx, sx = quantize_activations(x.float())
    qx = qx.double()  # integer dot products are exact in float64 whatever the order of their sums
    out = torch.empty(rows, columns, dtype=torch.float32, device=x.device)
    for n0 in range(0, columns, COLUMN_CHUNK):
        n1 = min(columns, n0 + COLUMN_CHUNK)
        qw = qweight[n0:n1].double().t()
        step = max(1, CHUNK_ELEMENTS // (n1 - n0))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            acc = (qx[r0:r1] @ qw).float()  # rounded once, as the kernel converts its int32 sums
            acc *= sx[r0:r1, None]
            acc *= wscale[n0:n1]
            if bias is not None:
                acc += bias[n0:n1]
            out[r0:r1, n0:n1] = acc
    return out


NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the native kernel reads and writes as they are


def _on_native(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype in NATIVE_DTYPES:
        return native.int8_linear(x, qweight, wscale, bias)
    return native.int8_linear(x.float(), qweight, wscale, bias).to(x.dtype)


@torch.library.custom_op("batcher::int8_linear", mutates_args=())
def native_int8_op(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The native kernel as an op that a compiled forward calls as it is (the compiler cannot trace into it)."""
    return _on_native(x, qweight, wscale, bias)


@native_int8_op.register_fake
def _(x, qweight, wscale, bias):
    return x.new_empty(*x.shape[:-1], wscale.shape[0])


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None,
                on_native: bool) -> torch.Tensor:
    """`y [..., N]` of `x [..., K]`, in x's dtype: on the native kernel where `on_native` (`native_int8`; `qweight`
    then in its layout, `native.int8_pack`), which takes x in any shape and float32 or bfloat16 x with no cast (a
    decode step makes ~120 of these calls: a reshape and a view in Python cost ~14 us each call on a slow CPU), and
    in a compiled forward through `native_int8_op`; else the reference in float32."""
    if on_native:
        if torch.compiler.is_compiling():
            return native_int8_op(x, qweight, wscale, bias)
        return _on_native(x, qweight, wscale, bias)  # the op's own dispatch costs for nothing here
    y = int8_linear_reference(x.reshape(-1, x.shape[-1]).float().contiguous(), qweight, wscale, bias)
    return y.to(x.dtype).view(*x.shape[:-1], wscale.shape[0])


class Int8Linear(torch.nn.Module):
    """A linear layer on int8 weights: `qweight` (int8 [out, in], or where the native kernel runs the same packed in
    its layout), `wscale` float32 [out] and `bias` float32 [out] (or None), as buffers; no float weight. Its input
    and output keep the model's dtype (computed in float32)."""

    def __init__(self, qweight: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None,
                 on_native: bool | None = None, in_features: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape[0], in_features or qweight.shape[1]
        self.on_native = native_int8(qweight.device) if on_native is None else on_native
        self.register_buffer("qweight", native.int8_pack(qweight) if self.on_native else qweight)
        self.register_buffer("wscale", wscale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def of(cls, module: torch.nn.Module, on_native: bool | None = None) -> Int8Linear:
        """The int8 copy of an `nn.Linear` (or transformers' `Conv1D`, whose weight is [in, out])."""
        weight = module.weight.detach()
        weight = weight.t() if isinstance(module, Conv1D) else weight
        qweight, wscale = quantize_weight(weight, rotated=True)
        return cls(qweight, wscale, module.bias, on_native, weight.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.wscale, self.bias, self.on_native)

    def eager(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` for an eager caller whose x is bf16 or fp32 (the fused decoder): the native kernel bound to
        this layer's tensors, where it runs (`native.int8_linear_on`)."""
        return native.int8_linear_on(self.qweight, self.wscale, self.bias) if self.on_native else self.forward

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={'native' if self.on_native else 'torch'}")


def quantizable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linears `quantize_linears` replaces, in the order a forward calls them: every `nn.Linear` (or `Conv1D`)
    of the decoder (its layers' attention and MLP projections, whatever the family names them), then the LM head."""
    found = [m for m in model.get_decoder().modules() if isinstance(m, (torch.nn.Linear, Conv1D))]
    head = model.get_output_embeddings()
    if isinstance(head, (torch.nn.Linear, Conv1D)) and all(head is not m for m in found):
        found.append(head)
    return found


def quantize_linears(model: torch.nn.Module, on_native: bool | None = None) -> int:
    """Replace the linears of `model`'s decoder and its LM head (`quantizable`) by `Int8Linear`s, in place; returns
    how many (0 for a model quantized already). A tied LM head is quantized as its own copy: the embedding table
    keeps the model's dtype. The int8 weights lie end to end in one buffer, in call order: a decode step streams
    one run of memory (on a CPU, on huge pages: `huge_page_buffer`), and q/k/v (gate/up) read as one matrix
    (`joint_linear`)."""
    targets = quantizable(model)
    if not targets:
        return 0
    first = targets[0].weight
    on_native = native_int8(first.device) if on_native is None else on_native
    sizes = [_stored_numel(*_out_in(m), on_native) for m in targets]
    dtype = torch.uint8 if on_native else torch.int8
    buffer = (huge_page_buffer(sum(sizes)).view(dtype) if first.device.type == "cpu"
              else torch.empty(sum(sizes), dtype=dtype, device=first.device))
    replaced, offset = {}, 0
    for module in targets:
        quantized = Int8Linear.of(module, on_native)
        size = quantized.qweight.numel()
        quantized.qweight = buffer[offset : offset + size].view_as(quantized.qweight).copy_(quantized.qweight)
        offset += size
        replaced[id(module)] = quantized
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) in replaced and name:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, replaced[id(module)])
    return len(targets)


def _out_in(module: torch.nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of an `nn.Linear` or a `Conv1D` (whose weight is [in, out])."""
    rows, columns = module.weight.shape
    return (columns, rows) if isinstance(module, Conv1D) else (rows, columns)


def _stored_numel(rows: int, columns: int, on_native: bool) -> int:
    """How many bytes an int8 weight of `rows` x `columns` is kept in: in the native kernel's layout, both rounded
    up (to whole tiles of outputs, to whole blocks of K)."""
    if not on_native:
        return rows * -(-columns // ROTATION) * ROTATION
    return -(-rows // native.INT8_TILE) * native.INT8_TILE * -(-columns // ROTATION) * ROTATION


def _one_matrix(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """Row-major matrices `parts` as one, where each starts where the one before ends in one storage (else None)."""
    for before, after in zip(parts, parts[1:]):
        if (after.shape[1:] != before.shape[1:] or not before.is_contiguous() or not after.is_contiguous()
                or after.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()
                or after.data_ptr() != before.data_ptr() + before.numel() * before.element_size()):
            return None
    return parts[0].as_strided((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].stride())


class Int8JointLinear:
    """`Int8Linear`s that read one input (q, k and v; gate and up) as one call on their int8 weights, viewed as one
    matrix (they lie end to end: `quantize_linears`); each output is its own dot product, so each module gets its
    own bits. Returns one output per module (views of one)."""

    def __init__(self, modules: list[Int8Linear]) -> None:
        self.modules = modules
        self.sizes = [module.out_features for module in modules]
        self.on_native = all(module.on_native for module in modules)
        # packed, a part whose outputs end inside a tile would leave that tile's padding between two parts
        aligned = not self.on_native or all(size % native.INT8_TILE == 0 for size in self.sizes[:-1])
        self.qweight = _one_matrix([module.qweight for module in modules]) if aligned else None
        self.wscale = torch.cat([module.wscale for module in modules])
        biases = [module.bias for module in modules]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [module.wscale.new_zeros(module.out_features) if b is None else b for b, module in zip(biases, modules)])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.qweight is None:
            return [module(x) for module in self.modules]
        return int8_linear(x, self.qweight, self.wscale, self.bias, self.on_native).split_with_sizes(self.sizes, -1)

    def eager(self) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        """`__call__` for an eager caller whose x is bf16 or fp32 (`Int8Linear.eager`)."""
        if self.qweight is None or not self.on_native:
            return self
        kernel, sizes = native.int8_linear_on(self.qweight, self.wscale, self.bias), self.sizes
        return lambda x: kernel(x).split_with_sizes(sizes, -1)


def joint_linear(modules: list[torch.nn.Module]) -> Int8JointLinear | JointLinear:
    """The joint call of `modules` for the fused decoder: on int8 weights where all are `Int8Linear`s."""
    if all(isinstance(module, Int8Linear) for module in modules):
        return Int8JointLinear(modules)
    return JointLinear(modules)
