"""The CPU kernels' builds (`kernels/csrc`): what each is made of (`BF16`, `FP32`, `INT8`), where a build lives,
how a process finds one, and how one is made (`python -m rqbatcher.kernels.build`, the Docker image's build step).

A build lives in a folder keyed by what it is made of: torch's version, the Python ABI, and a digest of its
sources, headers and compile flags, `<root>/<build name>/<torch>-<python>-<digest>/<build name>.so`. Builds of
other sources or another torch sit beside it, so two versions on one machine never rebuild each other.

The roots, in the order `find` reads them:
- `kernels/_prebuilt/` inside the installed package, read only: what a wheel or the Docker image carries,
  written by `python -m rqbatcher.kernels.build` (the image's build stage runs it; setup.py does for a wheel built where
  torch and a compiler are present);
- the cache, `$BATCHER_KERNELS_DIR` or else `$XDG_CACHE_HOME/batcher-kernels` (`~/.cache/batcher-kernels`):
  what `python -m rqbatcher.kernels.native` (`make setup`) and a worker started with `BATCHER_BUILD_KERNELS=1` build.

A build compiles each source with the command lines torch's JIT writes for a CPU extension (its public include
and library paths; no ninja, no torch `lock` file), in parallel (`MAX_JOBS`, else the CPUs this process may run
on), into a hidden folder beside its final one, which is then renamed into place: a build's folder holds a whole
build or does not exist.

Builders take the folder's lock (`kernels.build_lock`: an flock the kernel drops when its owner dies, however it
died, and a record of the owner that outlives it). Whoever takes it next, a builder or a `load` that found no
build and looks for one in progress, sees a build that never finished, logs it, and clears the record and the
half-built folder. A builder waits for a live one at most `BATCHER_KERNELS_LOCK_WAIT_S` (900 s), with a log line
at once and every 30 s, then gives up with the reason (torch's kernels run). A `load` not asked to build never
waits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from rqbatcher.kernels.build_lock import Lock, NotReady

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# Limits the C++ shares (kernels/csrc/common.h), passed as compile flags so the two cannot disagree.
LINEAR_MAX_ROWS = 4  # rows of x up to which small_linear beats oneDNN's packed bf16 linear (measured at 1-4)
MAX_QUERY_HEADS_PER_KV_HEAD = 8  # paged_decode
FP32_LINEAR_MAX_ROWS = 32  # rows of x up to which fp32_linear beats MKL (1.36x at 1 row, 1.9x at 2-4, 1.09x at 32)
INT8_BLOCK = 32  # values of K that int8_linear's passes take at a time (one AVX2 vector of int8, one AMX product)
# The least max |x| that an int8_linear block of x keeps (below it, zeros): 127 / 2**-121 is below float32's max
INT8_TINY = 2.0**-121
INT8_TILE = 16  # outputs per tile of int8_linear's packed weights (native.int8_pack): two vectors of 8 outputs
# int8_linear rotates x and W along K in blocks of this many values (a Hadamard transform after these signs flip
# values: bit i of INT8_SIGNS negates value i of each block), so that x's scale per row fits every block of it
INT8_ROTATION = 64
INT8_SIGNS = 0x9E3779B97F4A7C15
# at::parallel_for splits work across torch's threads only in a build compiled with OpenMP (without it, ATen's
# header runs the whole range on the calling thread: every kernel was single-threaded whatever --threads said); the
# link then names libgomp.so.1, which resolves to the copy torch has loaded, so torch.set_num_threads governs the
# build's threads too.
OPENMP = "-fopenmp"


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: `load(build)` runs in every kernel call
class Build:
    """One extension: its sources (headers included, for the digest), the CPU flags its instructions need, its
    compiler flags, and the folder of its sources."""

    label: str  # in the logs: "bf16 CPU kernels"
    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    compile_flags: tuple[str, ...]
    csrc: Path = CSRC


BF16 = Build("bf16", "batcher_cpu_kernels",
             ("cpu_kernels.cpp", "amx_linear.cpp", "avx512_linear.cpp", "amx_prefill.cpp", "amx_decode.cpp",
              "avx512_prefill.cpp", "layer_ops.cpp", "kv_write.cpp"),
             ("common.h", "amx.h", "row_cursor.h", "torch_sum.h", "prefill.h", "decode_call.h"),
             ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
             ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mamx-tile", "-mamx-bf16",
              OPENMP, f"-DLINEAR_MAX_ROWS={LINEAR_MAX_ROWS}",
              f"-DMAX_QUERY_HEADS_PER_KV_HEAD={MAX_QUERY_HEADS_PER_KV_HEAD}"))
FP32 = Build("fp32", "batcher_fp32_kernels",
             ("fp32_linear.cpp", "fp32_layer_ops.cpp", "fp32_decode.cpp", "kv_write.cpp"),
             ("avx2.h", "row_cursor.h", "torch_sum.h", "decode_call.h"), ("avx2", "fma"),
             # no FMA contraction: the layer ops round each product as torch's ops do (the kernels' FMAs are
             # written out)
             ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", OPENMP, f"-DFP32_LINEAR_MAX_ROWS={FP32_LINEAR_MAX_ROWS}",
              f"-DMAX_QUERY_HEADS_PER_KV_HEAD={MAX_QUERY_HEADS_PER_KV_HEAD}"))
# Linears on int8 weights (AVX2 integer dots; AVX-512 VNNI ones, and AMX-INT8 tile products, chosen at run time).
INT8 = Build("int8", "batcher_int8_kernels", ("int8_linear.cpp",), ("amx.h", "avx2.h", "int8_tiles.h"), ("avx2", "fma"),
             ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", OPENMP, f"-DINT8_BLOCK={INT8_BLOCK}",
              f"-DINT8_TILE={INT8_TILE}", f"-DINT8_TINY={INT8_TINY.hex()}f", f"-DINT8_ROTATION={INT8_ROTATION}",
              f"-DINT8_SIGNS={INT8_SIGNS:#x}ULL"))
BUILDS = (BF16, FP32, INT8)  # every build: `main` (the image's build stage, setup.py) compiles them all


PREBUILT = Path(__file__).parent / "_prebuilt"
# Left in PREBUILT by a wheel built without the kernels (setup.py, in pip's build isolation): that install asks its
# workers to build them at their start, before their first request, where a compiler exists.
BUILD_AT_START = "BUILD_AT_START"
DIR_ENV = "BATCHER_KERNELS_DIR"
BUILD_ENV = "BATCHER_BUILD_KERNELS"
LOCK_WAIT_ENV = "BATCHER_KERNELS_LOCK_WAIT_S"
LOCK_WAIT_S = 900.0
GB_PER_JOB = 2  # a compiler of one source takes about 1.5 GB (torch's headers)
SECONDS_PER_SOURCE = 45  # one core compiling one source (torch's headers at -O3): 35-40 s on a 2-core AMD EPYC
FORMAT = 1  # of a build's folder and command lines: bump when they change, so older builds are not read


def digest(build: Build) -> str:
    """Of everything that makes the build: its sources and headers (contents, not paths), flags and name."""
    h = hashlib.sha256(f"{FORMAT}\0{build.name}\0{' '.join(build.compile_flags)}\0".encode())
    for name in (*build.sources, *build.headers):
        h.update(f"{name}\0".encode() + (build.csrc / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def key(build: Build) -> str:
    import torch

    return f"{torch.__version__}-{sys.implementation.cache_tag}-{digest(build)}"


def cache_root() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batcher-kernels"


def roots() -> list[Path]:
    return [PREBUILT, cache_root()]


def library(build: Build, root: Path) -> Path:
    return root / build.name / key(build) / f"{build.name}.so"


def lock(build: Build, root: Path) -> Lock:
    """The lock of the build's folder under `root` (`rqbatcher.kernels.build_lock`)."""
    return Lock(build.label, library(build, root).parent)


def find(build: Build) -> Path | None:
    """The build of these sources for this torch and Python, prebuilt or cached, or None."""
    return next((path for path in (library(build, root) for root in roots()) if path.is_file()), None)


def import_library(build: Build, path: Path):
    """Import a built extension (torch must be imported first: the library links against it)."""
    import torch  # noqa: F401

    spec = importlib.util.spec_from_file_location(build.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_requested() -> bool:
    """Whether this process builds a missing build at its first `load`: as BATCHER_BUILD_KERNELS says, else as its
    install asks (BUILD_AT_START)."""
    value = os.environ.get(BUILD_ENV, "").strip().lower()
    if value:
        return value in ("1", "true", "yes", "on")
    return (PREBUILT / BUILD_AT_START).is_file()


def jobs() -> int:
    """Compilers at once: `MAX_JOBS`, else the CPUs this process may run on, at most one per GB_PER_JOB available."""
    if os.environ.get("MAX_JOBS", "").isdigit() and int(os.environ["MAX_JOBS"]) > 0:
        return int(os.environ["MAX_JOBS"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available_gb = int(meminfo.split("MemAvailable:")[1].split()[0]) / 2**20
    except (OSError, IndexError, ValueError):
        return cpus
    return max(1, min(cpus, int(available_gb // GB_PER_JOB)))


def estimate(builds: list[Build], workers: int | None = None) -> str:
    """How long compiling `builds` may take here, in words."""
    workers = workers or jobs()
    sources = sum(len(build.sources) for build in builds)
    seconds = math.ceil(sources / workers) * SECONDS_PER_SOURCE + 5 * len(builds)
    return f"about {math.ceil(seconds / 60)} min on {workers} core{'s' * (workers > 1)}"


def _commands(build: Build, folder: Path) -> tuple[list[list[str]], list[str]]:
    """The compile command of each source and the link command, as torch's JIT writes them for a CPU build."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = os.environ.get("CXX", "c++")
    includes = [*include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    cflags = [f"-DTORCH_EXTENSION_NAME={build.name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
              *(flag for path in includes for flag in ("-isystem", path)), "-fPIC", "-std=c++20",
              *build.compile_flags]
    objects = [str(folder / f"{Path(source).stem}.o") for source in build.sources]
    compiles = [[cxx, *cflags, "-c", str(build.csrc / source), "-o", obj]
                for source, obj in zip(build.sources, objects, strict=True)]
    openmp = [flag for flag in build.compile_flags if flag == OPENMP]  # links the libgomp torch has loaded already
    link = [cxx, *objects, "-shared", *openmp, *(f"-L{path}" for path in library_paths()), "-lc10", "-ltorch_cpu",
            "-ltorch", "-ltorch_python", "-o", str(folder / f"{build.name}.so")]
    return compiles, link


def _run(command: list[str], log_path: Path) -> None:
    with log_path.open("w") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as error:  # no compiler
            raise NotReady(f"{command[0]}: {error.strerror}") from error
    if done.returncode:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise NotReady(f"{Path(command[-3] if '-c' in command else command[-1]).name} failed "
                       f"(exit {done.returncode}):\n{tail}")


def _compile(builds: list[Build], root: Path, workers: int) -> dict[Build, Path | NotReady]:
    """Compile `builds` (their locks held) in one pool of `workers`; each into its hidden folder, then renamed."""
    temps = {build: library(build, root).parent.with_name(f".{key(build)}.tmp-{os.getpid()}") for build in builds}
    commands = {}
    for build, temp in temps.items():
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        commands[build] = _commands(build, temp)
    results: dict[Build, Path | NotReady] = {}
    start = time.monotonic()
    total = sum(len(compiles) for compiles, _ in commands.values())
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(_run, command, Path(command[-1] + ".log")): build
                   for build, (compiles, _) in commands.items() for command in compiles}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            build = futures[future]
            error = future.exception()
            if error is not None:
                results.setdefault(build, error if isinstance(error, NotReady) else NotReady(repr(error)))
            else:
                log.info("compiled %d of %d sources (%.0f s)", done, total, time.monotonic() - start)
    for build, temp in temps.items():
        if build not in results:
            try:
                _run(commands[build][1], temp / "link.log")
                for leftover in (*temp.glob("*.o"), *temp.glob("*.log")):  # the library is all a process loads
                    leftover.unlink()
                final = library(build, root).parent
                (temp / "build.json").write_text(json.dumps({"key": key(build), "sources": list(build.sources),
                                                             "flags": list(build.compile_flags)}))
                shutil.rmtree(final, ignore_errors=True)  # a folder only a build that finished leaves
                temp.rename(final)
                results[build] = library(build, root)
                log.info("built the %s CPU kernels in %.0f s: %s", build.label, time.monotonic() - start,
                         results[build])
                continue
            except NotReady as error:
                results[build] = error
        shutil.rmtree(temp, ignore_errors=True)
    return results


def make(builds: list[Build], root: Path, wait_s: float | None = None) -> dict[Build, Path | NotReady]:
    """Build what of `builds` is missing under `root`: each one's library path, or why it is not there."""
    if wait_s is None:
        wait_s = float(os.environ.get(LOCK_WAIT_ENV) or LOCK_WAIT_S)
    results: dict[Build, Path | NotReady] = {}
    locks = []
    try:
        for one in builds:
            if library(one, root).is_file():
                results[one] = library(one, root)
                continue
            held = lock(one, root)
            try:
                held.acquire(wait_s)
            except NotReady as error:
                results[one] = error
                continue
            if library(one, root).is_file():  # built by the holder we waited for
                held.close()
                results[one] = library(one, root)
                continue
            held.claim()
            locks.append((one, held))
        todo = [one for one, _ in locks]
        if todo:
            workers = min(jobs(), sum(len(one.sources) for one in todo))
            log.warning("building the %s CPU kernels (%d sources) under %s: this takes %s",
                        " and ".join(one.label for one in todo), sum(len(one.sources) for one in todo), root,
                        estimate(todo, workers))
            results.update(_compile(todo, root, workers))
    finally:
        for _, held in locks:
            held.release()
    return {one: results[one] for one in builds}


def load(build: Build, build_missing: bool):
    """The build's extension, imported from where it was built; built first into the cache if `build_missing`,
    else NotReady saying how to build it (a dead builder's lock is cleared on the way)."""
    path = find(build)
    if path is None and build_missing:
        path = make([build], cache_root())[build]
        if isinstance(path, NotReady):
            raise path
    if path is None:
        busy = lock(build, cache_root()).probe()
        import torch

        raise NotReady(f"not built for these sources and torch {torch.__version__}"
                       + (f" ({busy})" if busy else "")
                       + f": `python -m rqbatcher.kernels.native` builds them ({estimate([build])}); a worker "
                         f"started with {BUILD_ENV}=1 builds them at its start")
    try:
        return import_library(build, path)
    except Exception as error:  # noqa: BLE001  (a damaged file, a library torch does not match)
        raise NotReady(f"importing {path} failed ({error}); delete its folder and build again") from error


def main(argv: list[str] | None = None) -> int:
    every = {one.label: one for one in BUILDS}
    parser = argparse.ArgumentParser(prog="python -m rqbatcher.kernels.build", description=(
        "Build the CPU kernels, every build whatever this CPU runs, into a folder that loads without a compiler. "
        "The Docker image's build stage runs it; so does setup.py for a wheel, where torch is importable."))
    parser.add_argument("--into", type=Path, default=PREBUILT,
                        help="the root to build into (default: the installed package's kernels/_prebuilt, %(default)s)")
    parser.add_argument("--only", action="append", choices=sorted(every), help="build only these (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    builds = [every[label] for label in args.only or every]
    failed = 0
    for one, result in make(builds, args.into).items():
        failed += isinstance(result, NotReady)
        print(f"{one.label} CPU kernels:", f"FAILED: {result}" if isinstance(result, NotReady) else result, flush=True)
    if not failed:  # the install now carries its builds: its workers need not build at start
        (args.into / BUILD_AT_START).unlink(missing_ok=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
