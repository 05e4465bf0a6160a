"""The CPU kernels' builds (`kernels.build`): keyed by their sources' digest, built ahead of time by the script the
Docker image runs, loaded without a compiler, and a build whose process died noticed, cleared and reported.

Every test builds into folders of its own (`BATCHER_KERNELS_DIR`, `--into`), never the user's cache. Compiling a
real build takes minutes on 2 cores (about 40 s of one core per source), so the default tests compile the fp32
build only (4 sources) or a tiny extension; the full variants are `@pytest.mark.slow`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from rqbatcher.client import Client
from rqbatcher.kernels import build as builds
from rqbatcher.kernels import build_lock, native
from tests.reliability.support import RedisServer, greedy, wait_ready

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
TORCH_SITE = Path(torch.__file__).resolve().parents[1]  # the site-packages a fresh venv borrows torch from
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
SERVING_BOUND_S = 150  # a worker's start (torch, transformers, the model) and one job, on a busy 2-core machine

TINY_SOURCE = """\
#include <Python.h>
#include "version.h"
#define NAME2(x) #x
#define NAME(x) NAME2(x)
#define INIT2(x) PyInit_##x
#define INIT(x) INIT2(x)
static PyObject* version(PyObject*, PyObject*) { return PyLong_FromLong(VERSION); }
static PyMethodDef methods[] = {{"version", version, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
"""


def without_build_request() -> dict[str, str]:
    """This process's environment, less a BATCHER_BUILD_KERNELS a developer may have set for the session."""
    return {name: value for name, value in os.environ.items() if name != builds.BUILD_ENV}


def tiny_build(folder: Path, version: int) -> native.Build:
    """An extension of one small source and a header (a second or so to compile), built as the real ones are."""
    csrc = folder / "csrc"
    csrc.mkdir(parents=True, exist_ok=True)
    (csrc / "tiny.cpp").write_text(TINY_SOURCE)
    (csrc / "version.h").write_text(f"#define VERSION {version}\n")
    return native.Build("tiny", "batcher_test_tiny", ("tiny.cpp",), ("version.h",), (), ("-O0",), csrc=csrc)


def version_of(build: native.Build, path: Path) -> int:
    """The tiny extension's version, imported in a process of its own (one module name per process)."""
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('batcher_test_tiny', sys.argv[1])\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "print(module.version())\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


# ----- one folder per digest -----

def test_the_real_builds_are_keyed_by_content_torch_and_python_not_by_path(tmp_path):
    for build in native.BUILDS:
        copy = shutil.copytree(native.CSRC, tmp_path / build.label)  # a fresh copy each: builds share headers
        key = builds.key(build)
        assert key.startswith(f"{torch.__version__}-{sys.implementation.cache_tag}-")
        assert builds.key(dataclasses.replace(build, csrc=copy)) == key  # another checkout, the same sources
        header = copy / build.headers[0]
        header.write_text(header.read_text() + "\n// an edit\n")
        assert builds.key(dataclasses.replace(build, csrc=copy)) != key  # a header is part of the digest
        flags = dataclasses.replace(build, compile_flags=(*build.compile_flags, "-DANOTHER"))
        assert builds.key(flags) != key  # and so are the flags
        assert builds.library(build, tmp_path) == tmp_path / build.name / key / f"{build.name}.so"
    assert len({builds.key(build) for build in native.BUILDS}) == len(native.BUILDS) == 3


def test_builds_of_different_sources_live_in_different_folders_and_never_rebuild_each_other(tmp_path, caplog):
    root = tmp_path / "cache"
    one, same = tiny_build(tmp_path / "checkout-a", 1), tiny_build(tmp_path / "checkout-b", 1)
    assert builds.library(one, root) == builds.library(same, root)

    with caplog.at_level(logging.INFO, logger="rqbatcher.kernels.build"):
        first = builds.make([one], root)[one]
    assert first == builds.library(one, root) and version_of(one, first) == 1
    assert "building the tiny CPU kernels (1 sources)" in caplog.text

    two = tiny_build(tmp_path / "checkout-b", 2)  # checkout b moves on
    second = builds.make([two], root)[two]
    assert second.parent != first.parent and version_of(two, second) == 2
    built_at = first.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rqbatcher.kernels.build"):  # checkout a again: its build is still there
        assert builds.make([one], root)[one] == first and builds.make([two], root)[two] == second
    assert "building" not in caplog.text and first.stat().st_mtime_ns == built_at
    assert version_of(one, first) == 1 and version_of(two, second) == 2
    assert sorted(p.name for p in (root / one.name).iterdir() if p.is_dir()) == sorted(
        [first.parent.name, second.parent.name])  # two whole builds, no half-built folder left


def test_load_never_compiles_unless_asked_and_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv(builds.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(builds, "PREBUILT", tmp_path / "prebuilt")
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))  # a compile attempt would fail loudly
    tiny = tiny_build(tmp_path / "src", 1)
    with pytest.raises(builds.NotReady, match=r"not built for these sources and torch "
                                              r".*`python -m rqbatcher.kernels.native` builds them "
                                              r"\(about 1 min on \d+ cores?\)"):
        builds.load(tiny, build_missing=False)
    assert not (tmp_path / "cache").exists()  # nothing written, nothing compiled
    with pytest.raises(builds.NotReady, match=r"no-compiler: No such file or directory"):  # asked, but no compiler
        builds.load(tiny, build_missing=True)
    assert not [p for p in (tmp_path / "cache" / tiny.name).iterdir() if p.is_dir()]  # no build, whole or half
    assert builds.lock(tiny, tmp_path / "cache").record() is None
    monkeypatch.delenv("CXX")
    assert builds.load(tiny, build_missing=True).version() == 1  # asked to (BATCHER_BUILD_KERNELS=1): builds
    assert builds.find(tiny) == builds.library(tiny, tmp_path / "cache")


def test_an_install_without_prebuilt_kernels_asks_its_workers_to_build_them_at_start(tmp_path, monkeypatch):
    monkeypatch.setattr(builds, "PREBUILT", tmp_path / "prebuilt")
    monkeypatch.delenv(builds.BUILD_ENV, raising=False)
    assert not builds.build_requested()  # a checkout (make setup builds) or an install that carries its builds
    (tmp_path / "prebuilt").mkdir()
    (tmp_path / "prebuilt" / builds.BUILD_AT_START).write_text("no torch in the build environment")
    assert builds.build_requested()  # the marker a wheel built without them leaves
    monkeypatch.setenv(builds.BUILD_ENV, "0")
    assert not builds.build_requested()  # the operator's word wins


# ----- locks -----

def hold_lock(build: native.Build, root: Path, then: str) -> subprocess.Popen:
    """A process that takes the build's lock as a builder does, starts a half-built folder, and then either
    sleeps (a live builder) or is SIGKILLed (a build killed midway)."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from rqbatcher.kernels import build as builds, native
        tiny = native.Build("tiny", "batcher_test_tiny", ("tiny.cpp",), ("version.h",), (), ("-O0",),
                            csrc=Path({str(build.csrc)!r}))
        lock = builds.lock(tiny, Path({str(root)!r}))
        lock.acquire(5)
        lock.claim()
        half = builds.library(tiny, Path({str(root)!r})).parent.with_name(f".{{builds.key(tiny)}}.tmp-{{os.getpid()}}")
        half.mkdir(parents=True)
        (half / "tiny.o").write_bytes(b"half")
        print("holding", flush=True)
        if {then == "die"!r}:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_builder_killed_while_holding_the_lock_is_noticed_cleared_and_the_build_done(tmp_path, caplog):
    root = tmp_path / "cache"
    tiny = tiny_build(tmp_path / "src", 1)
    holder = hold_lock(tiny, root, then="die")
    assert holder.wait(30) == -signal.SIGKILL
    lock = builds.lock(tiny, root)
    assert lock.record()["pid"] == holder.pid  # the dead owner's record outlives it
    with caplog.at_level(logging.INFO, logger="rqbatcher.kernels.build"):
        start = time.monotonic()
        path = builds.make([tiny], root, wait_s=60)[tiny]
    assert time.monotonic() - start < 30  # no wait on a lock whose owner is dead
    assert version_of(tiny, path) == 1
    assert re.search(rf"build by pid {holder.pid} on \S+ \(started \d+ s ago\) never finished: its process died and "
                     rf"left its lock \({re.escape(str(lock.path))}\), which is now free; cleared it and its partial "
                     rf"build \(1 folder\(s\)\)", caplog.text), caplog.text
    assert lock.record() is None and not list((root / tiny.name).glob(".*.tmp-*"))


def test_a_live_builder_is_waited_for_within_a_bound_with_log_lines_and_then_given_up_on(tmp_path, caplog,
                                                                                          monkeypatch):
    root = tmp_path / "cache"
    tiny = tiny_build(tmp_path / "src", 1)
    holder = hold_lock(tiny, root, then="sleep")
    try:
        monkeypatch.setattr(build_lock, "WAIT_LOG_EVERY_S", 0.5)
        with caplog.at_level(logging.INFO, logger="rqbatcher.kernels.build"):
            start, start_wall = time.monotonic(), time.time()
            result = builds.make([tiny], root, wait_s=2)[tiny]
        assert 2 <= time.monotonic() - start < 10
        assert isinstance(result, builds.NotReady) and f"pid {holder.pid}" in str(result)
        waits = [r for r in caplog.records if r.getMessage().startswith("waiting for the tiny")]
        assert len(waits) >= 3 and all("giving up after 2 s" in r.getMessage() for r in waits)
        assert waits[0].created - start_wall < 1  # the first line at once, not after a period
        assert f"gave up waiting for the tiny CPU kernels' build by pid {holder.pid}" in caplog.text
        # a process that only looks (a worker not asked to build) neither waits nor touches a live build
        monkeypatch.setenv(builds.DIR_ENV, str(root))
        with pytest.raises(builds.NotReady, match=rf"being built now by pid {holder.pid} on "):
            builds.load(tiny, build_missing=False)
        assert builds.lock(tiny, root).record()["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


# ----- a worker killed in the middle of a kernel build -----

def native_build_here() -> tuple[builds.Build, str]:
    """The build a worker on this CPU class asks for (bf16 with AVX-512 BF16, else fp32 on AVX2), and the
    dtype that makes it ask."""
    flags = native.cpu_flags()
    for build, dtype in ((native.BF16, "bfloat16"), (native.FP32, "float32")):
        if native.why_not_here(build, flags) is None:
            return build, dtype
    pytest.skip("this CPU runs neither native build")


def start_worker(url: str, model_dir: Path, log_path: Path, env: dict) -> tuple[str, subprocess.Popen]:
    """A real `batcher worker` in the dtype of this CPU's native build (its runner asks `kernels.native` for that
    build at start), in a session of its own so that it can be killed with its compilers, as a container or pod is."""
    name = f"kb-{uuid.uuid4().hex[:8]}"
    command = [sys.executable, "-m", "rqbatcher", "worker", "--redis-url", url, "--queue", "kernels", "--model",
               str(model_dir), "--device", "cpu", "--dtype", native_build_here()[1], "--num-blocks", "64",
               "--max-num-seqs", "2", "--name", name]
    env = {**without_build_request(), **WORKER_ENV, "PYTHONPATH": str(ROOT), **env}
    process = subprocess.Popen(command, env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=log_path.open("w"), start_new_session=True)
    return name, process


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def kill_a_worker_midway_through_its_build(tmp_path, tiny_model_dir, url: str, cache: Path) -> int:
    """Start a worker asked to build this CPU's kernels, wait until its compilers run, SIGKILL it (and them)."""
    log_path = tmp_path / "killed.log"
    name, killed = start_worker(url, tiny_model_dir("llama"), log_path, {builds.DIR_ENV: str(cache),
                                                                          builds.BUILD_ENV: "1"})
    build = native_build_here()[0]
    lock = builds.lock(build, cache)
    try:
        deadline = time.monotonic() + SERVING_BOUND_S
        while not (lock.path.is_file() and (lock.record() or {}).get("pid") == killed.pid
                   and list(lock.folder.parent.glob(".*.tmp-*/*.o.log"))):  # claimed, and compiling
            assert killed.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"the worker did not start its build: {log_path.read_text()}"
            time.sleep(0.1)
        assert re.search(rf"WARNING rqbatcher.kernels.build: building the {build.label} CPU kernels "
                         rf"\({len(build.sources)} sources\) under "
                         rf"{re.escape(str(cache))}: this takes about \d+ min on \d+ cores?", log_path.read_text())
    finally:
        kill_group(killed)
    return killed.pid


@pytest.fixture
def redis_url(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server.url
    server.stop()


def serve_one_job(url: str, name: str, process: subprocess.Popen) -> None:
    client = Client(url, queue="kernels")
    wait_ready(client.connection, name, process)
    job_id = client.submit(greedy(3, prompt_token_ids=[5, 6, 7]))
    assert len(client.result(job_id, timeout=60).token_ids) == 3


def test_a_worker_killed_midway_through_a_kernel_build_leaves_the_next_worker_serving_with_the_reason_logged(
        tmp_path, tiny_model_dir, redis_url):
    cache = tmp_path / "kernels-cache"
    dead = kill_a_worker_midway_through_its_build(tmp_path, tiny_model_dir, redis_url, cache)

    log_path = tmp_path / "next.log"
    start = time.monotonic()
    name, worker = start_worker(redis_url, tiny_model_dir("llama"), log_path, {builds.DIR_ENV: str(cache)})
    try:
        serve_one_job(redis_url, name, worker)
        assert time.monotonic() - start < SERVING_BOUND_S
    finally:
        kill_group(worker)
    log = log_path.read_text()
    build = native_build_here()[0]
    lock = builds.lock(build, cache)
    assert re.search(rf"WARNING rqbatcher.kernels.build_lock: the {build.label} CPU kernels' build by pid {dead} "
                     rf"on \S+ \(started \d+ s ago\) never finished: its process died and left its lock "
                     rf"\({re.escape(str(lock.path))}\), which is now free; cleared it and its partial build "
                     rf"\(1 folder\(s\)\)", log), log
    assert re.search(rf"WARNING rqbatcher.kernels.native: {build.label} CPU kernels unavailable \(not built for "
                     r"these sources and torch "
                     r".*`python -m rqbatcher.kernels.native` builds them \(about \d+ min on \d+ cores?\); a worker "
                     r"started with BATCHER_BUILD_KERNELS=1 builds them at its start\): torch's kernels run instead",
                     log), log
    assert lock.record() is None and not list(lock.folder.parent.glob(".*.tmp-*"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_worker_asked_to_build_after_a_killed_build_clears_it_builds_and_serves_on_the_kernels(
        tmp_path, tiny_model_dir, redis_url):
    cache = tmp_path / "kernels-cache"
    dead = kill_a_worker_midway_through_its_build(tmp_path, tiny_model_dir, redis_url, cache)
    log_path = tmp_path / "next.log"
    name, worker = start_worker(redis_url, tiny_model_dir("llama"), log_path, {builds.DIR_ENV: str(cache),
                                                                               builds.BUILD_ENV: "1"})
    try:
        client = Client(redis_url, queue="kernels")
        deadline = time.monotonic() + 1200  # the build first: about 4 min on 2 cores, longer on a busy machine
        while not client.connection.exists(f"rq:worker:{name}"):
            assert worker.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        serve_one_job(redis_url, name, worker)
    finally:
        kill_group(worker)
    log = log_path.read_text()
    assert f"build by pid {dead} on " in log and "never finished: its process died" in log
    build = native_build_here()[0]
    assert f"building the {build.label} CPU kernels ({len(build.sources)} sources)" in log and "unavailable" not in log
    assert builds.library(build, cache).is_file()
