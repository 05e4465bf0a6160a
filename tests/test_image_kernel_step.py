"""The Docker image's kernel build step (deploy/Dockerfile's build stage), run as written in a fresh venv: no Docker
daemon exists here, so the test installs the package from exactly the files the stage copies and runs the stage's
own `python -m rqbatcher.kernels.build` line, then loads the result with no compiler, as the runtime stage does."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rqbatcher.kernels import build as builds
from rqbatcher.kernels import native
from tests.test_kernel_build import DOCKERFILE, ROOT, TORCH_SITE, without_build_request


def build_stage() -> str:
    text = DOCKERFILE.read_text()
    return text.split(" AS build\n", 1)[1].split("\nFROM ", 1)[0]


def kernel_step() -> tuple[str, str]:
    """The build stage's RUN that builds the kernels, and the WORKDIR it runs in."""
    stage = build_stage()
    (run,) = [line for line in stage.splitlines() if line.startswith("RUN ") and "rqbatcher.kernels.build" in line]
    workdir = re.findall(r"^WORKDIR (\S+)$", stage[:stage.index(run)], flags=re.MULTILINE)[-1]
    return run.removeprefix("RUN "), workdir


def fresh_venv_with_the_image_install(tmp_path) -> tuple[Path, Path]:
    """A venv that holds the package as the build stage installs it (a wheel of the files the stage COPYs), and
    sees torch and the other dependencies through a .pth file naming this venv's site-packages (no network)."""
    context = tmp_path / "context"
    context.mkdir()
    for line in re.findall(r"^COPY (?!--)(.+)$", build_stage(), flags=re.MULTILINE):
        *sources, _ = line.split()
        for source in sources:
            (shutil.copytree if (ROOT / source).is_dir() else shutil.copy)(ROOT / source, context / source)
    shutil.rmtree(context / "kernels" / "_prebuilt", ignore_errors=True)  # the image ignores a checkout's builds
    wheels = tmp_path / "wheels"
    # The image's `pip install ".[worker]"` builds in isolation, without torch, so setup.py skips the kernels:
    # BATCHER_KERNELS_AT_INSTALL=0 does the same here without the network.
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(wheels), str(context)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "BATCHER_KERNELS_AT_INSTALL": "0"})
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("rqbatcher-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")  # no kernels inside: a pure wheel
    with zipfile.ZipFile(wheel) as contents:  # but its workers are asked to build them at their start
        assert f"rqbatcher/kernels/_prebuilt/{builds.BUILD_AT_START}" in contents.namelist()
        assert not [n for n in contents.namelist() if "/experiments/" in n], "development experiments left out"
        assert "rqbatcher/workers/bench/run.py" in contents.namelist(), "`batcher bench` ships"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed-torch.pth").write_text(f"{TORCH_SITE}\n")  # read after the venv's own site-packages
    return python, site


PROBE = """
import json
import os
import torch
from rqbatcher.kernels import build as builds, native
assert not builds.build_requested()
found = {}
for build in native.BUILDS:
    path = builds.find(build)
    if path is None:
        continue
    if native.unavailable_reason(build) is not None:  # a build whose instructions this CPU lacks
        continue
    module = native.load(build)  # served from `path`
    assert module.__file__ == str(path)
    x, weight = torch.randn(3, 64), torch.randn(64)
    if build is native.INT8:  # its one kernel, on an int8 weight of scale 1 (only x's quantization errs)
        qweight = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
        want = x @ qweight.float().T
        got = module.int8_linear(x, native.int8_pack(qweight), torch.ones(32), None)
        assert torch.allclose(got, want, atol=0.02 * want.abs().max().item()), (got - want).abs().max()
        found[build.label] = str(path)
        continue
    if build is native.FP32:
        linear = torch.randn(32, 64)
        assert torch.allclose(module.fp32_linear(x, linear, None), x @ linear.T, atol=1e-4)
    reference = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    dtype = torch.float32 if build is native.FP32 else torch.bfloat16
    got = module.rms_norm(x.to(dtype), weight.to(dtype), 1e-6).float()
    assert torch.allclose(got, reference, atol=0.05, rtol=0.02), (got - reference).abs().max()
    found[build.label] = str(path)
print(json.dumps({"kernels": native.__file__, "found": found}))
"""


def run_the_image_kernel_step(tmp_path, extra: str = "") -> tuple[Path, Path, dict]:
    python, site = fresh_venv_with_the_image_install(tmp_path)
    command, workdir = kernel_step()
    assert command.startswith("python -m rqbatcher.kernels.build")
    unused_cache = tmp_path / "user-cache"
    env = {**without_build_request(), "PATH": f"{python.parent}:{os.environ['PATH']}",
           builds.DIR_ENV: str(unused_cache)}
    env.pop("PYTHONPATH", None)
    step = subprocess.run(["sh", "-c", command + extra], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert step.returncode == 0, step.stdout + step.stderr
    assert "building the" in step.stderr and str(site / "rqbatcher" / "kernels" / "_prebuilt") in step.stderr
    # The runtime stage: no compiler, only the venv. Load from the package's _prebuilt alone.
    env["CXX"] = str(tmp_path / "no-compiler")
    probe = subprocess.run([str(python), "-c", PROBE], cwd=workdir, env=env, capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, probe.stderr
    result = json.loads(probe.stdout)
    assert result["kernels"].startswith(str(site))  # the installed package, not the checkout
    assert not unused_cache.exists()  # nothing built at load
    return python, site, result["found"]


def test_the_dockerfile_kernel_step_in_a_fresh_venv_builds_a_folder_that_loads_without_a_compiler(tmp_path):
    """The image's step with `--only fp32` (the build of 4 sources; the full step is the slow variant)."""
    _, site, found = run_the_image_kernel_step(tmp_path, " --only fp32")
    prebuilt = site / "rqbatcher" / "kernels" / "_prebuilt"
    assert found == {"fp32": str(builds.library(native.FP32, prebuilt))}
    (folder,) = [p for p in (prebuilt / native.FP32.name).iterdir() if p.is_dir()]  # one whole build, none half
    assert folder.name == builds.key(native.FP32) and builds.lock(native.FP32, prebuilt).record() is None
    assert sorted(p.name for p in folder.iterdir()) == ["batcher_fp32_kernels.so", "build.json"]  # what loads


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_dockerfile_kernel_step_as_written_carries_every_build(tmp_path):
    _, site, found = run_the_image_kernel_step(tmp_path)
    prebuilt = site / "rqbatcher" / "kernels" / "_prebuilt"
    assert found == {build.label: str(builds.library(build, prebuilt)) for build in native.BUILDS}
