"""The CPU kernels of `kernels/csrc`, built ahead of time (`rqbatcher.kernels.build`) and loaded without a compiler.

Three builds, each for the CPUs whose instructions it uses. On a CPU with AVX-512 BF16 (`BF16`), they take
the places of a bf16 step where torch's own kernels fall short:
- decode attention (`paged_decode`): one call per layer reads every decode's keys straight from the paged
  cache, in the arithmetic of the AVX-512 prefill kernel (a query gets the same bits from either);
- linear layers at few rows, which must stream every weight once: `small_linear` (AVX-512, up to 4 rows, on the
  plain weight) and `tile_linear` (up to 32, on a copy of the weight in AMX's tile order: AMX tile products
  where the CPU has AMX, else AVX-512 BF16 products); batch invariant, `tile_linear` takes every row count
  (docs/batch-invariance.md);
- prefill attention (`prefill`: on AMX tiles where the CPU has them, else on AVX-512 BF16), where torch's flash
  kernel spends most of its time outside the matmuls;
- a decoder layer's small ops (`rms_norm`, `add_rms_norm`, `rotary_`, `silu_mul`), one call each where
  transformers' modules make 3 to 27 torch ops (`rqbatcher.workers.model.fused_decoder`).
On an AVX2 CPU (`FP32`), `fp32_linear` takes a fp32 decode step's linears (up to 32 rows), which torch's kernels
read at well below the memory's pace there (on CPUs with AVX-512 too: a lone fp32 step 0.61x on an AMD EPYC Zen 4,
0.78x on an Intel Xeon with AMX); `paged_decode` and the layer ops but `silu_mul` run in fp32. Either build writes a
step's keys and values to the cache (`write_kv`), in any dtype.

The int8 build (`INT8`: AVX2 and FMA, so it loads on every AVX2 CPU, AVX-512 ones included, beside either build
above) holds `int8_linear`: `x @ W.T + b` on weights of one byte (symmetric per output channel, `wscale`), x and W
rotated along K in blocks of INT8_ROTATION (64: a Hadamard transform after fixed sign flips, INT8_SIGNS) and x
quantized with one scale per row, exact integer dots (llama.cpp's Q8_0 dot on AVX2; AVX-512 VNNI's where the CPU
has it, and from 24 rows AMX-INT8 tile products where it has those, chosen at run time, with the same bits), for
8-bit models: a decode step streams a quarter of fp32's bytes. Any number of rows, each computed in one order
whatever the rows beside it and the threads (batch invariant). The arithmetic is written in
kernels/csrc/int8_linear.cpp's header; workers/model/int8_linear.py holds torch's reference of it.

What each build is made of (sources, CPU flags, compile flags) is defined in `kernels.build`, and named here too.
`load()` imports a build made ahead of time and never compiles unless asked to. It looks for a build of these
very sources (and headers and flags) for this torch and Python (`rqbatcher.kernels.build`: the folder is keyed by their
digest): first in the package (`kernels/_prebuilt/`, what a wheel or the image carries), then in the cache
(`$BATCHER_KERNELS_DIR`, else `~/.cache/batcher-kernels`). Where none exists it returns None and logs once, as a
warning, that the kernels are not built, how to build them and about how long that takes: torch's kernels, which
stay the reference, run meanwhile, as they do on a CPU without the build's instructions. A process started with
`BATCHER_BUILD_KERNELS=1`, or from an install that asks for it (`rqbatcher.kernels.build.BUILD_AT_START`), builds the
missing one into the cache at its first `load()` instead, after a log line saying so and how long it takes
(`BATCHER_BUILD_KERNELS=0` says no). A build whose process died is noticed and cleared by the next process that looks
(`rqbatcher.kernels.build`: an flock the kernel frees, and a bounded, logged wait for a live one).

How each install gets its kernels:
- `make setup` (a checkout): `python -m rqbatcher.kernels.native` builds what this CPU runs into the cache, once per
  source digest and torch (about 3 min on 2 cores for the bf16 build).
- The Docker image: its build stage runs `python -m rqbatcher.kernels.build`, which compiles every build (bf16,
  fp32, int8) into the installed package's `_prebuilt/`; the runtime stage, which has no compiler, carries them.
- A wheel built where torch and a compiler are importable in the build environment (torch installed first, then
  `pip install --no-build-isolation 'rqbatcher[worker]'` or `pip wheel --no-build-isolation .`): setup.py runs the
  same build, so the wheel (tagged for this Python and platform) carries every build for that torch version.
- A plain `pip install 'rqbatcher[worker]'` or `pip wheel .` (build isolation: torch is not in the build
  environment, and is not pulled into it) carries none, but asks for them (`BUILD_AT_START`): a worker builds them
  into the cache at its start, before its first request, where a compiler exists (once per machine, digest and
  torch), else runs torch's kernels with the reason logged. A wheel whose torch was since upgraded does the same.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from rqbatcher.kernels import build as builds
from rqbatcher.kernels.build import (  # noqa: F401  (what each build is made of; callers read them here)
    BF16,
    BUILDS,
    CSRC,
    FP32,
    FP32_LINEAR_MAX_ROWS,
    INT8,
    INT8_BLOCK,
    INT8_ROTATION,
    INT8_SIGNS,
    INT8_TILE,
    INT8_TINY,
    LINEAR_MAX_ROWS,
    MAX_QUERY_HEADS_PER_KV_HEAD,
    Build,
)

log = logging.getLogger(__name__)

SUPPORTED_HEAD_DIMS = (64, 128)  # of every attention kernel
TILE_MAX_ROWS = 32  # rows up to which tile_linear beats oneDNN's packed kernels (it takes any number)
TILE_COLUMNS = 16  # output columns of a block of tile_pack's layout (the blocks of a weight lie in order)
AMX_FLAGS = ("amx_tile", "amx_bf16")  # what the AMX kernels need besides the bf16 build's flags


class Unavailable(Exception):
    """Why a build cannot run here."""


@functools.cache
def cpu_flags() -> set[str]:
    """The CPU's flags, as /proc/cpuinfo names them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def why_not_here(build: Build, flags: set[str]) -> Unavailable | None:
    """Why `build` does not run on a CPU of `flags` (`cpu_flags`): the flags it lacks; None where it runs."""
    missing = [flag for flag in build.cpu_flags if flag not in flags]
    return Unavailable(f"this CPU lacks {', '.join(missing)}") if missing else None


def _load(build: Build):
    reason = why_not_here(build, cpu_flags())
    if reason is not None:
        raise reason
    try:
        return builds.load(build, build_missing=builds.build_requested())
    except builds.NotReady as reason:  # not built, a failed build: torch's kernels serve instead
        raise Unavailable(str(reason)) from reason


@functools.cache
def _status(build: Build):
    """(the built extension, None) or (None, why it cannot run here); looked up (or built, where asked) and logged
    once."""
    try:
        module = _load(build)
    except Unavailable as reason:
        log.warning("%s CPU kernels unavailable (%s): torch's kernels run instead", build.label, reason)
        return None, str(reason)
    log.info("%s CPU kernels loaded%s from %s", build.label,
             " (with AMX)" if build is BF16 and module.amx_permitted() else "", module.__file__)
    return module, None


def load(build: Build = BF16):
    """The built extension, or None where it cannot run here (`unavailable_reason` says why)."""
    return _status(build)[0]


def unavailable_reason(build: Build = BF16) -> str | None:
    return _status(build)[1]


def build_for(dtype: torch.dtype) -> Build:
    """The build whose `paged_decode` and layer ops (`rms_norm`, `add_rms_norm`, `rotary_`) take `dtype`."""
    return FP32 if dtype == torch.float32 else BF16


def loaded_for(dtype: torch.dtype):
    """The extension whose kernels take `dtype` (`build_for`); a RuntimeError saying why where it cannot run here."""
    build = build_for(dtype)
    module = load(build)
    if module is None:
        raise RuntimeError(f"the {build.label} CPU kernels cannot run here: {unavailable_reason(build)}")
    return module


def why_not(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the kernels cannot serve a model of these shapes on `device` in `dtype`, or None when they can."""
    if device.type != "cpu":
        return f"they run on a CPU, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"they run in bfloat16 or float32, not {str(dtype).removeprefix('torch.')}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}"
    if heads % kv_heads or heads // kv_heads > MAX_QUERY_HEADS_PER_KV_HEAD:
        return f"{heads} query heads over {kv_heads} KV heads (at most {MAX_QUERY_HEADS_PER_KV_HEAD} per KV head)"
    return unavailable_reason(build_for(dtype))


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scaling: float) -> torch.Tensor:
    """Decode attention `query [B, H, D]`, bf16 or fp32, over the paged cache: sequence b's keys are its first
    `context_lens[b]` positions, in blocks `block_tables[b]` (padding past them is never read). In bf16, in the
    arithmetic of the prefill kernel that runs here (`prefill`), so a query gets the same bits from either: on AMX
    `amx_decode`, else the bf16 build's `paged_decode`."""
    kernels = loaded_for(query.dtype)
    kernel = kernels.amx_decode if query.dtype == torch.bfloat16 and has_amx() else kernels.paged_decode
    return kernel(query, k_cache, v_cache, block_tables, context_lens, block_size, scaling)


def cpu_has_amx() -> bool:
    return all(flag in cpu_flags() for flag in AMX_FLAGS)


@functools.cache  # asked at every prefill and few-row linear call
def has_amx() -> bool:
    """Whether the AMX kernels run here: the CPU has AMX, and the OS lends it to this process (the kernels
    must have loaded)."""
    return cpu_has_amx() and load().amx_permitted()


def tile_pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `weight [N, K]` laid out in AMX's tiles, for `tile_linear`."""
    return load().amx_pack(weight)


def tile_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """`x @ weight.T + bias`, `packed` from `tile_pack(weight)`: on AMX where it runs (`amx_linear`), else on
    AVX-512 BF16 (`avx512_linear`, 1.04-1.45x oneDNN's packed kernels at 2-32 rows on an AMD EPYC Zen 5). Any
    number of rows, each summed in one order whatever the rows beside it (batch invariance)."""
    return getattr(load(), _tile_kernel())(x, packed, bias, out_features)


def tile_linear_on(packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`tile_linear` bound to one weight, its kernel chosen once: for an eager caller of many calls a step (the
    fused decoder). The kernel is looked up at each call, so a benchmark may wrap it."""
    kernels, name = load(), _tile_kernel()
    return lambda x: getattr(kernels, name)(x, packed, bias, out_features)


def _tile_kernel() -> str:
    return "amx_linear" if has_amx() else "avx512_linear"


def prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            ctx_start: int, block_size: int, scaling: float) -> torch.Tensor:
    """Causal bf16 attention of a prompt chunk `query [n, H, D]` at positions `ctx_start...` over its sequence's
    keys in the paged cache, `block_table` covering all `ctx_start + n` of them (the chunk's own included:
    write them first). On AMX where it runs (`amx_prefill`, 4.3-4.4x `avx512_prefill`'s pace at chunks of 512),
    else on AVX-512 BF16 (`avx512_prefill`); `paged_decode` runs the same arithmetic, so a query gets the same bits
    as a decode and in a chunk of any bounds."""
    kernel = load().amx_prefill if has_amx() else load().avx512_prefill
    return kernel(query, k_cache, v_cache, block_table, ctx_start, block_size, scaling)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` for bf16 x of at most LINEAR_MAX_ROWS rows."""
    return load().small_linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of each row of bf16 or fp32 `x [..., H]`, `weight [H]`."""
    return loaded_for(x.dtype).rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += delta` in place, then `rms_norm(residual, weight, eps)`: a decoder's residual add and the
    norm after it."""
    return loaded_for(residual.dtype).add_rms_norm(residual, delta, weight, eps)


def rotary_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate `query [T, H, D]` and `key [T, Hkv, D]` in place by the rotary module's `cos` and `sin [T, D]`,
    as transformers' `apply_rotary_pos_emb` does."""
    loaded_for(query.dtype).rotary_(query, key, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, the gated MLP's activation, in bf16."""
    return load().silu_mul(gate, up)


def loaded() -> Build | None:
    """The build that runs on this CPU (at most one does), or None."""
    return next((build for build in (BF16, FP32) if load(build) is not None), None)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`k_cache[slot_mapping] = key` and the same for values `[T, kv_heads, head_dim]`, of the caches' dtype;
    where `loaded()`."""
    load(loaded()).write_kv(key, value, k_cache, v_cache, slot_mapping)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` for fp32 x of at most FP32_LINEAR_MAX_ROWS rows."""
    return load(FP32).fp32_linear(x, weight, bias)


def fp32_linear_on(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fp32_linear` bound to one weight, for an eager caller of many calls a step (the fused decoder; as
    `tile_linear_on`)."""
    kernels = load(FP32)
    return lambda x: kernels.fp32_linear(x, weight, bias)


def int8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """`qweight` int8 `[N, K]` laid out as `int8_linear` reads it, front to back (kernels/csrc/int8_linear.cpp):
    uint8 `[ceil(N / 16), 16 * K']` with K' = K rounded up to whole INT8_ROTATIONs, zeros past N and K; in each tile of
    16 outputs, K in steps of 4 bytes, each step holding those 4 bytes of every output side by side, each byte
    q + 128."""
    rows, columns = qweight.shape
    padded = torch.nn.functional.pad(qweight, (0, -columns % INT8_ROTATION, 0, -rows % INT8_TILE))
    tiles, width = padded.shape[0] // INT8_TILE, padded.shape[1]
    steps = padded.view(tiles, INT8_TILE, width // 4, 4).transpose(1, 2).contiguous()
    return torch.bitwise_xor(steps.view(torch.uint8), 0x80).view(tiles, INT8_TILE * width)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor,
                bias: torch.Tensor | None, isa: str = "") -> torch.Tensor:
    """`x @ W.T + bias` for fp32 or bf16 `x [..., K]` (any number of rows; the result in x's dtype) on W's int8
    values `packed` by `int8_pack` (W rotated as x is) and its per-row scales `wscale` fp32 `[N]`, x rotated and
    quantized per row (kernels/csrc/int8_linear.cpp); the torch reference's bits; where `load(INT8)` is not None.
    `isa`: the variant (`avx2`, `avx512-vnni`, `amx-int8`), by default this CPU's best for the rows
    (`load(INT8).isa(rows)`); every variant gives the same bits."""
    return load(INT8).int8_linear(x, packed, wscale, bias, isa)


def int8_linear_on(packed: torch.Tensor, wscale: torch.Tensor,
                   bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`int8_linear` bound to one weight, for fp32 or bf16 x, this CPU's best variant: for an eager caller of many
    calls a step (the fused decoder: ~120 in a lone step, where a module's way to the kernel cost ~2.5 us a call
    against the kernel's own ~1.2 us on an Intel Xeon). The kernel is looked up at each call, so a benchmark may wrap
    it."""
    kernels = load(INT8)
    return lambda x: kernels.int8_linear(x, packed, wscale, bias, "")


def main() -> int:
    """`python -m rqbatcher.kernels.native`: build (into the cache) and load what this CPU runs, where missing."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ[builds.BUILD_ENV] = "1"  # this process is asked to build
    for build in BUILDS:
        state = "ready" if load(build) is not None else f"unavailable: {unavailable_reason(build)}"
        print(f"{build.label} CPU kernels:", state, flush=True)
    return 0


if __name__ == "__main__":
    from rqbatcher.kernels import native  # the module the workers import, not this __main__ copy

    sys.exit(native.main())
