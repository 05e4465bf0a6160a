"""The int8 CPU kernel (`native.int8_linear`, kernels/csrc/int8_linear.cpp, on weights packed by
`native.int8_pack`) against a float64 reference of its arithmetic (int8 weights with a scale per output channel, x
rotated in blocks of 64 along K and quantized with one scale per row, exact integer dots), within far less than one
quantization step, and against the model's torch reference (workers/model/int8_linear.py), whose bits it gives. Each
row's bits must not depend on the rows beside it, nor on the threads.

It runs on every CPU with AVX2 and FMA (elsewhere these tests skip); a CPU that has them but fails to build it fails
here. Where the CPU has AVX-512 VNNI, its variant runs by default and must give the AVX2 variant's bits; where it
has AMX-INT8 too, the AMX variant runs from its threshold of rows (`AMX_MIN_ROWS`) and must give them as well.
"""

import pytest
import torch

from rqbatcher.kernels import native
from rqbatcher.workers.model.int8_linear import TINY, int8_linear_reference, rotate

BLOCK = native.INT8_BLOCK
ROTATION = native.INT8_ROTATION
pytestmark = pytest.mark.skipif(any(flag not in native.cpu_flags() for flag in native.INT8.cpu_flags),
                                reason="the int8 kernel needs AVX2 and FMA")
HAS_VNNI = {"avx512_vnni", "avx512vl", "avx512bw"} <= set(native.cpu_flags())
HAS_AMX_INT8 = HAS_VNNI and {"amx_tile", "amx_int8"} <= set(native.cpu_flags())
VARIANTS = ["avx2", *(["avx512-vnni"] if HAS_VNNI else []), *(["amx-int8"] if HAS_AMX_INT8 else [])]


def int8_unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int8 `[out_features, in_features]` matrix that `native.int8_pack` packed (its layout read backwards)."""
    tiles, width = packed.shape[0], packed.shape[1] // native.INT8_TILE
    steps = torch.bitwise_xor(packed, 0x80).view(torch.int8).view(tiles, width // 4, native.INT8_TILE, 4)
    return steps.transpose(1, 2).reshape(tiles * native.INT8_TILE, width)[:out_features, :in_features]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's weights: int8 [N, K'] and fp32 [N] of `weight [N, K]` rotated as x is (K' whole blocks of
    ROTATION), symmetric per output channel (a zero row: scale 0, q 0)."""
    weight = rotate(weight.float()) / ROTATION
    amax = weight.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)
    return torch.round(weight * inv).clamp(-127, 127).to(torch.int8), (amax / 127).squeeze(-1)


def reference(x, qweight, wscale, bias):
    """y = wscale * sx * (exact int dot) + bias, in float64 from the same quantized values (x rotated as the contract
    rotates it, in float32: `rotate`)."""
    N, rows = qweight.shape[0], x.reshape(-1, x.shape[-1]).shape[0]
    values = rotate(x.reshape(rows, -1).float())
    amax = values.abs().amax(-1, keepdim=True)
    # 127 / amax as one fp32 division, as the kernel does (torch's `127.0 / amax` is `amax.reciprocal() * 127`); a
    # row below TINY is zeros
    inv = torch.where(amax >= TINY, torch.full_like(amax, 127.0) / amax, 0.0)
    qx = torch.round(values * inv).clamp(-127, 127)
    sx = torch.where(amax < TINY, 0.0, amax / 127)
    terms = sx.double() * (qx.double() @ qweight.double().T)
    y = wscale.double() * terms + (0 if bias is None else bias.double())
    scale = wscale.double() * terms.abs()  # what the float operations' rounding is relative to
    return y.reshape(*x.shape[:-1], N), scale.reshape(*x.shape[:-1], N)


def operands(rows, K, N, seed, bias=True):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
    weight = torch.randn(N, K, generator=generator) * 0.05
    qweight, wscale = quantize_weight(weight)
    return x, qweight, wscale, torch.randn(N, generator=generator) if bias else None


def kernel(x, qweight, wscale, bias, isa=""):
    """The kernel on `qweight` int8 [N, K], packed as a layer keeps it."""
    return native.int8_linear(x, native.int8_pack(qweight), wscale, bias, isa)


def check(x, qweight, wscale, bias, isa=""):
    got = kernel(x, qweight, wscale, bias, isa)
    want, scale = reference(x, qweight, wscale, bias)
    assert got.dtype == torch.float32 and got.shape == want.shape
    error = (got.double() - want).abs()
    assert (error <= 1e-5 * scale + 1e-6).all(), error.max()


def test_the_kernel_builds_on_a_cpu_it_serves():
    assert native.load(native.INT8) is not None, native.unavailable_reason(native.INT8)
    assert native.load(native.INT8).block == BLOCK and native.load(native.INT8).tile == native.INT8_TILE
    wide = "avx512-vnni" if HAS_VNNI else "avx2"
    assert [native.load(native.INT8).isa(rows) for rows in (1, 23, 24, 500)] == [wide, wide, *[VARIANTS[-1]] * 2]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 31, 33, 100])
@pytest.mark.parametrize("K, N", [(64, 12), (100, 7), (576, 37), (5, 3), (33, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("isa", VARIANTS)
def test_int8_linear_matches_the_reference(rows, K, N, with_bias, isa):
    """Rows in fours, pairs and alone, W's rows in fours and a remainder, K of whole rotation blocks and not."""
    check(*operands(rows, K, N, seed=rows * 1000 + K + N, bias=with_bias), isa=isa)


@pytest.mark.parametrize("isa", VARIANTS)
def test_every_row_count_of_a_decode_step_gives_the_references_bits(isa):
    """1 to 33 rows: passes of a variant's rows over a tile and their remainders (AVX2: 4, 2, 1), or passes of their
    exact count (VNNI: up to 16 each), and from 32 rows passes over three tiles (here 3: every tile in one); K of whole
    rotation blocks and a shorter last one."""
    x, qweight, wscale, bias = operands(33, 200, 40, seed=17)
    for rows in range(1, 34):
        assert torch.equal(kernel(x[:rows], qweight, wscale, bias, isa),
                           int8_linear_reference(x[:rows], qweight, wscale, bias)), rows


@pytest.mark.parametrize("isa", VARIANTS)
def test_it_gives_the_torch_references_bits(isa):
    """The same operations in the same order as the model's reference: the bits, not only the values, agree, for
    fp32 x and for bf16 x (whose result is the reference's rounded to bf16); one row over W's tiles side by side
    (AVX2's 4, VNNI's 12 on an Intel CPU) and the tiles left over."""
    for rows, K, N in ((1, 576, 37), (1, 100, 64), (1, 576, 150), (1, 576, 467), (4, 64, 16), (5, 33, 9),
                       (70, 300, 101), (130, 1536, 24), (3, 7, 5)):
        x, qweight, wscale, bias = operands(rows, K, N, seed=rows + 2 * K + N)
        for b in (bias, None):
            assert torch.equal(kernel(x, qweight, wscale, b, isa), int8_linear_reference(x, qweight, wscale, b))
            half = x.bfloat16()
            want = int8_linear_reference(half.float(), qweight, wscale, b).bfloat16()
            assert torch.equal(kernel(half, qweight, wscale, b, isa), want)


@pytest.mark.parametrize("N, K", [(1, 1), (16, 32), (13, 70), (37, 576), (16, 33)])
def test_packing_lays_16_outputs_side_by_side_and_unpacks_to_the_same_matrix(N, K):
    qweight = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=torch.Generator().manual_seed(N + K))
    packed = native.int8_pack(qweight)
    width = -(-K // ROTATION) * ROTATION  # K rounded up to whole rotation blocks
    assert packed.dtype == torch.uint8 and packed.shape == (-(-N // 16), 16 * width)
    assert torch.equal(int8_unpack(packed, N, K), qweight)
    n, k = N - 1, K - 1  # the last output's last value: tile n // 16, step k // 4, place n % 16 in it, byte k % 4
    assert packed[n // 16, (k // 4) * 64 + (n % 16) * 4 + k % 4].item() == qweight[n, k].item() + 128
    whole = int8_unpack(packed, 16 * packed.shape[0], width)
    assert not whole[N:].any() and not whole[:, K:].any()  # zeros past N and past K


@pytest.mark.parametrize("isa", VARIANTS)
def test_bf16_x_gives_the_float_results_rounded_to_bf16(isa):
    """A bf16 model's linears call the kernel with no cast: bf16 in, the fp32 result rounded as torch rounds out."""
    for rows, K, N in ((1, 576, 37), (5, 33, 9), (70, 300, 101)):
        x, qweight, wscale, bias = operands(rows, K, N, seed=rows + K)
        xb = x.bfloat16()
        got = kernel(xb, qweight, wscale, bias, isa)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, kernel(xb.float(), qweight, wscale, bias, isa).bfloat16()), (rows, K, N)


@pytest.mark.parametrize("isa", VARIANTS[1:])  # none (skipped) on an AVX2-only CPU
def test_every_wider_variant_gives_the_avx2_variants_bits(isa):
    """Rows in whole tiles of 16 and not, one block and many, K with a shorter last rotation block (shorter than
    half a block too), W's tiles with padding, more rows than a pass over W takes at once (VNNI's 128, AMX's 256);
    fp32 and bf16 x, which the wider variants rotate and quantize on 512-bit vectors."""
    for rows, K, N in ((1, 576, 37), (3, 100, 9), (7, 64, 12), (16, 32, 16), (17, 1536, 40), (70, 300, 101),
                       (130, 33, 5), (300, 96, 17), (5, 7, 3)):
        x, qweight, wscale, bias = operands(rows, K, N, seed=rows + K + N)
        for xs, b in ((x, bias), (x, None), (x.bfloat16(), bias)):
            assert torch.equal(kernel(xs, qweight, wscale, b, isa), kernel(xs, qweight, wscale, b, "avx2")), (
                rows, K, N, xs.dtype)


@pytest.mark.parametrize("isa", VARIANTS[1:])
def test_a_nan_an_infinity_a_zero_or_a_tiny_block_gives_the_avx2_variants_bits(isa):
    """The wider variants rotate and quantize a row on 512-bit vectors: a NaN or an infinity anywhere makes its row
    NaN, and a block of zeros, of subnormal values or of the largest finite ones changes nothing else, as on AVX2,
    in a row of whole rotation blocks and a shorter last one."""
    x, qweight, wscale, bias = operands(6, 1100, 24, seed=11)
    x[0, 40] = float("nan")
    x[1, 600] = float("-inf")
    x[2, 64:96] = 0  # a zero block; the rest of the row as usual
    x[3, 96:128] = 1e-40  # subnormal
    x[4, 1090] = float("inf")  # in the shorter last block
    x[5, 1024:1056] = -3e30  # large, its outputs still finite
    for xs in (x, x.bfloat16()):
        got = kernel(xs, qweight, wscale, bias, isa)
        torch.testing.assert_close(got, kernel(xs, qweight, wscale, bias, "avx2"), rtol=0, atol=0, equal_nan=True)
        assert got[[0, 1, 4]].isnan().all() and torch.isfinite(got[[2, 3, 5]]).all()


@pytest.mark.parametrize("isa", VARIANTS)
def test_a_row_of_subnormals_counts_as_zeros_in_the_kernel_and_the_reference(isa):
    """127 / amax overflows float32 below TINY: a row whose rotated values all lie below it is zeros (scale 0: its
    outputs are the bias), where x * inf would give NaNs. A row whose max is TINY itself is quantized as any."""
    x, qweight, wscale, bias = operands(4, 100, 19, seed=9)
    x[0] = 1e-40  # every value subnormal,
    x[0, 7] = 0.0  # one a zero
    x[1] = -3e-40
    x[2] = torch.linspace(-1, 1, 100) * TINY * 0.125  # its rotated max near TINY: kept
    got = kernel(x, qweight, wscale, bias, isa)
    assert torch.isfinite(got).all() and torch.equal(got[0], bias) and torch.equal(got[1], bias)
    without_bias = kernel(x, qweight, wscale, None, isa)
    assert not without_bias[:2].any() and without_bias[2].any()
    assert torch.equal(got, int8_linear_reference(x, qweight, wscale, bias))
    check(x, qweight, wscale, bias, isa)


def test_zero_rows_of_w_and_x_and_zero_blocks_give_zeros_not_nans():
    x, qweight, wscale, bias = operands(6, 200, 10, seed=3)
    x[2] = 0  # a zero row of x
    x[4, 32:64] = 0  # zeros inside a row
    x[5, 192:] = 0  # a zero last (shorter) rotation block
    qweight[[0, 7]], wscale[[0, 7]] = 0, 0  # zero rows of W, as quantize_weight makes them
    y = kernel(x, qweight, wscale, bias)
    assert torch.isfinite(y).all()
    assert torch.equal(y[2], bias) and torch.equal(y[:, 0], bias[0].expand(6))
    check(x, qweight, wscale, bias)


@pytest.mark.parametrize("isa", VARIANTS)
def test_a_nan_or_inf_in_a_row_of_x_makes_that_row_nan_and_no_other(isa):
    x, qweight, wscale, bias = operands(4, 100, 19, seed=4)
    x[1, 40], x[3, 99] = float("nan"), float("inf")  # in a whole rotation block, in the last (shorter) one
    y = kernel(x, qweight, wscale, bias, isa)
    assert y[[1, 3]].isnan().all() and torch.isfinite(y[[0, 2]]).all()
    check(x[[0, 2]], qweight, wscale, bias, isa)
    # in bf16 too: the same rows NaN, the others rounded as torch rounds
    xb = x.bfloat16()
    got, wide = kernel(xb, qweight, wscale, bias, isa), kernel(xb.float(), qweight, wscale, bias, isa)
    assert torch.equal(got.isnan(), wide.isnan()) and torch.equal(got[[0, 2]], wide[[0, 2]].bfloat16())


def test_it_approximates_the_float_linear_it_quantizes():
    """Within 1.5%: Gaussian x, one scale for 576 values (a model's activations, whose few large values the rotation
    spreads, lose less to a row's scale than to blocks of 32: docs/benchmark-log.md)."""
    generator = torch.Generator().manual_seed(5)
    x, weight, bias = torch.randn(4, 576, generator=generator), torch.randn(96, 576, generator=generator), None
    y = kernel(x, *quantize_weight(weight), bias)
    want = x @ weight.T
    assert ((y - want).norm() / want.norm()).item() < 0.015


def test_leading_dimensions_a_strided_x_and_no_rows():
    x, qweight, wscale, bias = operands(6, 96, 10, seed=7)
    strided = torch.stack([x, x], -1)[..., 0].view(2, 3, 96)  # [2, 3, 96], not contiguous
    assert not strided.is_contiguous()
    y = kernel(strided, qweight, wscale, bias)
    assert y.shape == (2, 3, 10) and torch.equal(y.view(6, 10), kernel(x, qweight, wscale, bias))
    assert kernel(torch.zeros(0, 96), qweight, wscale, bias).shape == (0, 10)


def test_a_rows_bits_do_not_depend_on_its_batch():
    x, qweight, wscale, bias = operands(130, 200, 37, seed=11)
    alone = torch.cat([kernel(x[r:r + 1], qweight, wscale, bias) for r in range(len(x))])
    generator = torch.Generator().manual_seed(0)
    # tiles of 8, 4, 2, 1 rows, AMX's of 16 and of fewer (from 10 rows where it runs), chunks of 64 rows
    for size in (*range(1, 18), 31, 32, 33, 63, 64, 65, 100, 130):
        for _ in range(2):
            picked = torch.randperm(len(x), generator=generator)[:size]
            assert torch.equal(kernel(x[picked], qweight, wscale, bias), alone[picked]), size


@pytest.mark.parametrize("isa", VARIANTS)
def test_the_threads_do_not_change_the_bits(isa):
    threads = torch.get_num_threads()
    x, qweight, wscale, bias = operands(70, 300, 1001, seed=13)
    try:
        torch.set_num_threads(1)
        one = kernel(x, qweight, wscale, bias, isa)
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, qweight, wscale, bias, isa), one)
        assert torch.equal(kernel(x[:3], qweight, wscale, bias, isa), one[:3])
        assert torch.equal(kernel(x[:1], qweight, wscale, bias, isa), one[:1])  # AVX2: tiles side by side, split
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("call, message", [
    (lambda p, s: native.int8_linear(torch.randn(2, 8).double(), p, s, None), "x must be an fp32 or bf16 CPU tensor"),
    (lambda p, s: native.int8_linear(torch.randn(2, 8), p.view(torch.int8), s, None), "must be packed"),
    (lambda p, s: native.int8_linear(torch.randn(2, 8), p.repeat(1, 2)[:, ::2], s, None), "must be packed"),
    (lambda p, s: native.int8_linear(torch.randn(2, 80), p, s, None), r"80 features need \[1, 2048\]"),
    (lambda p, s: native.int8_linear(torch.randn(2, 8), p, torch.ones(17), None), r"17 scales and 8 features need"),
    (lambda p, s: native.int8_linear(torch.randn(2, 8), p, s.half(), None), "wscale must be an fp32"),
    (lambda p, s: native.int8_linear(torch.randn(2, 8), p, s, torch.randn(3)), "bias has 3 values"),
    (lambda p, s: native.int8_linear(torch.randn(2, 8), p, s, None, "avx10"), "no int8 variant 'avx10'"),
])
def test_it_refuses_what_it_cannot_compute(call, message):
    qweight, wscale = quantize_weight(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=message):
        call(native.int8_pack(qweight), wscale)


@pytest.mark.skipif(HAS_VNNI, reason="this CPU has AVX-512 VNNI")
def test_the_vnni_variant_is_refused_where_the_cpu_lacks_it():
    qweight, wscale = quantize_weight(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="this CPU has no AVX-512 VNNI"):
        kernel(torch.randn(2, 8), qweight, wscale, None, "avx512-vnni")


@pytest.mark.skipif(HAS_AMX_INT8, reason="this CPU has AMX-INT8")
def test_the_amx_variant_is_refused_where_the_cpu_lacks_it():
    qweight, wscale = quantize_weight(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="this CPU has no AMX-INT8"):
        kernel(torch.randn(2, 8), qweight, wscale, None, "amx-int8")
