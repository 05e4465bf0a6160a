"""The bf16 CPU kernels of `kernels/csrc`, built on first use and cached.

On a CPU with AVX-512 BF16 they take the places of a bf16 step where torch's own kernels fall short:
- decode attention (`paged_decode`): one call per layer reads every decode's keys straight from the paged
  cache;
- linear layers at few rows, which must stream every weight once: `small_linear` (AVX-512, up to 4 rows) and
  `amx_linear` (Intel AMX, up to 32);
- on AMX, prefill attention (`amx_prefill`), where torch's flash kernel spends most of its time outside the
  matmuls.

`load()` builds the extension with torch's C++ toolchain (about 25 s, once per machine and torch version,
cached under `~/.cache/torch_extensions`) and returns None, with the reason logged once, where it cannot:
no compiler, no AVX-512 BF16, a build error. The callers then keep torch's kernels, which stay the reference.

`python -m kernels.native` builds it ahead of time (`make setup` does), so no worker pays the build.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("cpu_kernels.cpp", "amx_linear.cpp", "amx_prefill.cpp")]
EXTENSION_NAME = "batcher_cpu_kernels"
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # what the kernels' instructions need
AMX_FLAGS = ("amx_tile", "amx_bf16")  # what the AMX kernels need besides
SUPPORTED_HEAD_DIMS = (64, 128)  # of every attention kernel
# Limits the C++ shares (kernels/csrc/common.h), passed as compile flags so the two cannot disagree.
LINEAR_MAX_ROWS = 4  # rows of x up to which small_linear beats oneDNN's packed bf16 linear (measured at 1-4)
AMX_MAX_ROWS = 32  # rows of x that amx_linear takes (two tiles of 16)
MAX_QUERY_HEADS_PER_KV_HEAD = 8  # paged_decode
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mamx-tile", "-mamx-bf16",
                 f"-DLINEAR_MAX_ROWS={LINEAR_MAX_ROWS}", f"-DAMX_MAX_ROWS={AMX_MAX_ROWS}",
                 f"-DMAX_QUERY_HEADS_PER_KV_HEAD={MAX_QUERY_HEADS_PER_KV_HEAD}"]

class Unavailable(Exception):
    """Why the kernels cannot run here."""


@functools.cache
def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _build():
    missing = [flag for flag in CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(missing)}")
    from torch.utils.cpp_extension import load

    try:
        return load(EXTENSION_NAME, [str(source) for source in SOURCES], extra_cflags=[*COMPILE_FLAGS, _source_digest()],
                    verbose=False)
    except Exception as error:  # a missing compiler or ninja, a failed build: torch's kernels serve instead
        raise Unavailable(f"building kernels/csrc failed: {error}") from error


def _source_digest() -> str:
    """A flag naming the sources' contents, headers included: torch rebuilds when its flags change, but it
    hashes only the .cpp files it is given."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])))
    return f"-DBATCHER_KERNELS_SOURCE={digest.hexdigest()[:16]}"


@functools.cache
def _status():
    """(the built extension, None) or (None, why it cannot run here); built and logged once."""
    try:
        module = _build()
    except Unavailable as reason:
        log.warning("bf16 CPU kernels unavailable (%s): torch's kernels run instead", reason)
        return None, str(reason)
    log.info("bf16 CPU kernels loaded%s", " (with AMX)" if module.amx_permitted() else "")
    return module, None


def load():
    """The built extension, or None where it cannot run here (`unavailable_reason` says why)."""
    return _status()[0]


def unavailable_reason() -> str | None:
    return _status()[1]


def why_not(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the kernels cannot serve a model of these shapes on `device` in `dtype`, or None when they can."""
    if device.type != "cpu":
        return f"they run on a CPU, not {device.type}"
    if dtype != torch.bfloat16:
        return f"they run in bfloat16, not {str(dtype).removeprefix('torch.')}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}"
    if heads % kv_heads or heads // kv_heads > MAX_QUERY_HEADS_PER_KV_HEAD:
        return f"{heads} query heads over {kv_heads} KV heads (at most {MAX_QUERY_HEADS_PER_KV_HEAD} per KV head)"
    return unavailable_reason()


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scaling: float) -> torch.Tensor:
    """Decode attention `query [B, H, D]` over the paged cache: sequence b's keys are its first
    `context_lens[b]` positions, in blocks `block_tables[b]` (padding past them is never read)."""
    return load().paged_decode(query, k_cache, v_cache, block_tables, context_lens, block_size, scaling)


def cpu_has_amx() -> bool:
    return all(flag in cpu_flags() for flag in AMX_FLAGS)


def has_amx() -> bool:
    """Whether the AMX kernels run here: the CPU has AMX, and the OS lends it to this process (the kernels
    must have loaded)."""
    return cpu_has_amx() and load().amx_permitted()


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `weight [N, K]` laid out in AMX's tiles, for `amx_linear`."""
    return load().amx_pack(weight)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """`x @ weight.T + bias` for x of at most AMX_MAX_ROWS rows, `packed` from `amx_pack(weight)`."""
    return load().amx_linear(x, packed, bias, out_features)


def amx_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                ctx_start: int, block_size: int, scaling: float) -> torch.Tensor:
    """Causal attention of a prompt chunk `query [n, H, D]` at positions `ctx_start...` over its sequence's
    keys in the paged cache, `block_table` covering all `ctx_start + n` of them (the chunk's own included:
    write them first)."""
    return load().amx_prefill(query, k_cache, v_cache, block_table, ctx_start, block_size, scaling)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` for x of at most LINEAR_MAX_ROWS rows."""
    return load().small_linear(x, weight, bias)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("bf16 CPU kernels:", "ready" if load() is not None else "unavailable (torch's kernels will run)")
    sys.exit(0)
