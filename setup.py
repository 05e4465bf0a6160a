"""The package's metadata is in pyproject.toml; this adds one build step: the CPU kernels (kernels/csrc), every
build (bf16, fp32, int8), compiled into the wheel's `rqbatcher/kernels/_prebuilt/` by
`python -m rqbatcher.kernels.build`'s code, where torch and a C++ compiler are in the build environment.

torch is deliberately not a build requirement: with pip's build isolation (the default) the build environment
has setuptools only, so the wheel is the light, pure one (`pip install rqbatcher` for producers never pulls torch)
and this step says why it skips. To build a wheel that carries the kernels, install torch first and build without
isolation: `pip install --no-build-isolation "rqbatcher[worker]"` or `pip wheel --no-build-isolation .`. That wheel
is tagged for this Python and platform, and its kernels load only with the torch version they were built against
(`kernels/native.py` says how each install path gets its kernels). A wheel without them carries a marker instead
(`kernels.build.BUILD_AT_START`): its workers build the kernels at their start, before their first request, with a
log line first. BATCHER_KERNELS_AT_INSTALL=0 skips the step.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
SKIP_ENV = "BATCHER_KERNELS_AT_INSTALL"
# Each folder of the checkout and the import name it installs under: `batcher`, `workers` and `kernels` are other
# distributions' names on the package registry (Hugging Face's `kernels` among them), `rqbatcher` is ours.
PACKAGE_FOLDERS = {"rqbatcher": "batcher", "rqbatcher.workers": "workers", "rqbatcher.kernels": "kernels"}
# benchmarks/ and tests/ (the fake engines among them) are not mapped: they run from a checkout and never ship.
PACKAGE_DATA = {"rqbatcher": ["data/*.jsonl"], "rqbatcher.workers": ["bench/workloads/*.jsonl"],
                "rqbatcher.kernels": ["csrc/*.cpp", "csrc/*.h"]}


def packages() -> list[str]:
    """Every package under the mapped folders, by its installed name."""
    found = []
    for name, folder in PACKAGE_FOLDERS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(HERE / folder)]
    return found


@functools.cache
def why_no_kernels() -> str | None:
    """Why this build cannot compile the kernels, or None where it can (checked without importing torch)."""
    if os.environ.get(SKIP_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{SKIP_ENV}=0"
    if importlib.util.find_spec("torch") is None:
        return ("torch is not importable in the build environment (pip's build isolation; install torch first and "
                "build with --no-build-isolation to carry the kernels)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    return None


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "rqbatcher" / "kernels" / "_prebuilt"
        shutil.rmtree(target, ignore_errors=True)  # never a stale copy from an earlier build
        if self.editable_mode:  # an editable install reads the checkout, where `make setup` builds the kernels
            return
        reason = why_no_kernels()
        if reason is not None:
            print(f"batcher: the wheel carries no prebuilt CPU kernels ({reason}); its workers build them at their "
                  "start where a compiler exists", file=sys.stderr)
            target.mkdir(parents=True)
            (target / "BUILD_AT_START").write_text(f"This install carries no prebuilt CPU kernels: {reason}.\n")
            return
        sys.path.insert(0, self.build_lib)  # the package as this build laid it out, not an installed one
        try:
            from rqbatcher.kernels import build as kernel_build
        finally:
            sys.path.remove(self.build_lib)
        print(f"batcher: building the CPU kernels into the wheel ({target})", file=sys.stderr)
        if kernel_build.main(["--into", str(target)]) != 0:
            print("batcher: a kernel build failed (above); the wheel carries what did build, and workers run "
                  "torch's kernels where one is missing", file=sys.stderr)
        for lock in target.glob("*/*.lock"):  # this build's own folder: nobody else waits on its locks
            lock.unlink()


class KernelsDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        """Compiled kernels inside: a wheel for this Python and platform only, installed as platlib."""
        return why_no_kernels() is None


setup(packages=packages(), package_dir=PACKAGE_FOLDERS, package_data=PACKAGE_DATA, distclass=KernelsDistribution,
      cmdclass={"build_py": BuildPyWithKernels})
