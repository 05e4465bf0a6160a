"""llama.cpp's server as a peer in `python -m benchmarks.compare` (`llama-server`): what a CPU user would run instead.

Built once into the cache folder: `pip download` fetches the `llama-cpp-python` source package, which vendors
llama.cpp; cmake builds its `llama-server`; its `convert_hf_to_gguf.py` converts the run's checkpoint to a GGUF
in the run's dtype, or to Q8_0 (llama.cpp's 8-bit blocks, what its CPU users run) where batcher runs
`--quantization int8`; a peer named with a GGUF type (`llama-server:q4_k_m`) runs that type instead, and its
`llama-quantize` (built beside the server) makes the 4-bit Q4_K_M from the f32 conversion. The bench then starts
the server with `--parallel` = the slots, the same threads, and the token budget as its batch size, and drives it
over HTTP with each request's token ids, `n_predict`, `ignore_eos` and greedy sampling, at the workload's arrival
times; tokens are stamped as they stream back. Without cmake (or a local checkpoint) the system is skipped, with
the reason in the report.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.private_redis import free_port
from rqbatcher.config import QUANTIZATION_INT8, EngineConfig
from rqbatcher.workers.bench.record import PeakRss, SystemRun, by_arrival, wait_until
from rqbatcher.workers.bench.workload import WorkloadRequest
from rqbatcher.workers.engine.engine import WARMUP_REQUEST
from rqbatcher.workers.model.loading import cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the source package whose vendored llama.cpp is built
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
GGUF_INT8 = "q8_0"  # int8 weights in blocks of 32 with a scale each: llama.cpp's peer of --quantization int8
GGUF_QUANTIZED = {"q4_k_m": "Q4_K_M"}  # types llama-quantize makes from the f32 GGUF: 4-bit k-quants, a CPU favourite
GGUF_CHOICES = (*GGUF_TYPES.values(), GGUF_INT8, *GGUF_QUANTIZED)  # what a peer may name
STARTUP_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 3600
CONTEXT_ROUNDING = 256  # each slot's context: the longest request, rounded up to this
NO_REPACK = "--no-repack"  # llama-server's plain CPU kernels, where its repacked (AMX) ones crash (`start_server`)


class SystemUnavailable(RuntimeError):
    """A system that cannot run on this machine; the bench skips it and says why."""


def _root() -> Path:
    return cache_dir() / "llama-server"


def _source() -> Path:
    return _root() / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


def _fetch_source() -> Path:
    """The vendored llama.cpp of the `llama-cpp-python` sdist, downloaded and unpacked once."""
    if (_source() / "CMakeLists.txt").exists():
        return _source()
    root = _root()
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(root)], check=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    return _source()


def server_binary(jobs: int = 1) -> Path:
    """`llama-server`, built once with cmake (a few CPU minutes per job... tens on a small machine)."""
    return _tool("llama-server", jobs)


def _tool(target: str, jobs: int) -> Path:
    """One of llama.cpp's programs, built once with cmake; a second one reuses the first's build of the library."""
    build = _root() / f"build-{LLAMA_CPP_PYTHON_VERSION}"
    binary = build / "bin" / target
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise SystemUnavailable("llama-server: cmake is missing, so llama.cpp cannot be built (install cmake and a "
                                "C++ compiler to compare with it)")
    source = _fetch_source()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=OFF"],
                   check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", target, "-j", str(jobs)], check=True)
    return binary


def gguf_type(dtype: str, quantization: str) -> str:
    """The GGUF type that matches batcher's run: Q8_0 for int8 weights, else the dtype."""
    return GGUF_INT8 if quantization == QUANTIZATION_INT8 else GGUF_TYPES[dtype]


def gguf_checkpoint(model_dir: Path, outtype: str, jobs: int = 1) -> Path:
    """The checkpoint as a GGUF of `outtype` (one of GGUF_CHOICES), made once by llama.cpp's own programs:
    convert_hf_to_gguf.py, then for GGUF_QUANTIZED llama-quantize on the f32 conversion (built with `jobs`)."""
    if not (model_dir / "config.json").exists():
        raise SystemUnavailable(f"llama-server: needs a local checkpoint folder to convert, not {model_dir}")
    target = _root() / f"{model_dir.name}-{outtype}.gguf"
    if not target.exists():
        staging = target.with_suffix(f".tmp-{os.getpid()}")
        if outtype in GGUF_QUANTIZED:
            tool = _tool("llama-quantize", jobs)
            command = [str(tool), str(gguf_checkpoint(model_dir, GGUF_TYPES["float32"])), str(staging),
                       GGUF_QUANTIZED[outtype]]
        else:
            tool = _fetch_source() / "convert_hf_to_gguf.py"
            command = [sys.executable, str(tool), str(model_dir), "--outfile", str(staging), "--outtype", outtype]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp's {tool.name} failed on {model_dir}:\n{done.stderr[-2000:]}")
        staging.rename(target)
    return target


def _post(port: int, body: dict, on_tokens) -> None:
    """POST a streamed /completion; `on_tokens(ids)` for each chunk of tokens as it arrives."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"llama-server answered {response.status}: {response.read()[:500]!r}")
        for line in response:
            if line.startswith(b"data: "):
                chunk = json.loads(line[6:])
                if chunk.get("tokens"):
                    on_tokens(chunk["tokens"])
                if chunk.get("stop"):
                    return
    finally:
        conn.close()


def _request(prompt: list[int], max_tokens: int, prefix_caching: bool) -> dict:
    return {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "stream": True, "return_tokens": True, "cache_prompt": prefix_caching}


class StartupFailed(RuntimeError):
    """llama-server exited before it became healthy, with `returncode` (negative: killed by that signal)."""

    def __init__(self, returncode: int, log: Path) -> None:
        super().__init__(f"llama-server exited with {returncode} at start-up ({log} says why)")
        self.returncode = returncode


def start_server(command: list[str], port: int, log: Path) -> tuple[subprocess.Popen, str]:
    """llama-server from `command`, healthy on `port` (its output in `log`), and a note where it runs without its
    weight repacking: llama.cpp 0.3.36's AMX matmul (Q8_0 repacked for AMX-INT8) crashed at start-up on an Intel
    Xeon with AMX, so a server killed by a signal at start-up is started once more with --no-repack (its plain CPU
    kernels), which a user who met that crash would run."""
    try:
        return _start_healthy(command, port, log), ""
    except StartupFailed as failure:
        if failure.returncode >= 0:
            raise
        note = (f"llama-server was killed by signal {-failure.returncode} at start-up with its weight repacking, "
                f"so it runs with {NO_REPACK}")
    return _start_healthy([*command, NO_REPACK], port, log), note


def _start_healthy(command: list[str], port: int, log: Path) -> subprocess.Popen:
    """The server, once it answers /health; stopped again where it never does."""
    with log.open("w") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise StartupFailed(server.returncode, log)
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    server.kill()
    server.wait()
    raise RuntimeError(f"llama-server did not become healthy within {STARTUP_TIMEOUT_S} s")


def run_llama_server(workload: list[WorkloadRequest], vocab_size: int, model_dir: Path, config: EngineConfig,
                     threads: int, name: str, outtype: str = "") -> SystemRun:
    """The workload through llama-server on the checkpoint as a GGUF of `outtype` (by default `gguf_type`'s)."""
    outtype = outtype or gguf_type(config.dtype, config.quantization)
    binary, gguf = server_binary(), gguf_checkpoint(model_dir, outtype)
    longest = max(w.prompt_len + w.max_tokens for w in workload)
    per_slot = -(-longest // CONTEXT_ROUNDING) * CONTEXT_ROUNDING
    port = free_port()
    server, note = start_server([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                 "--parallel", str(config.max_num_seqs), "--threads", str(threads),
                                 "--threads-batch", str(threads), "--ctx-size", str(per_slot * config.max_num_seqs),
                                 "--batch-size", str(config.max_num_batched_tokens),
                                 "--ubatch-size", str(config.max_num_batched_tokens), "--no-webui",
                                 *([] if config.prefix_caching else ["--cache-ram", "0"])],
                                port, _root() / "llama-server.log")
    try:
        _post(port, _request(WARMUP_REQUEST.prompt_token_ids, WARMUP_REQUEST.sampling.max_tokens, False),
              lambda ids: None)
        run = _drive(workload, vocab_size, port, config, name, server.pid, outtype)
        run.notes.extend([note] if note else [])
        return run
    finally:
        server.terminate()
        server.wait(timeout=30)


def _drive(workload: list[WorkloadRequest], vocab_size: int, port: int, config: EngineConfig, name: str,
           pid: int, outtype: str) -> SystemRun:
    """Submit each request at its arrival time, each on its own connection, and stamp its tokens."""
    from benchmarks.peers import _steps_from_stamps

    run = SystemRun(name, slots=config.max_num_seqs, token_times={w.id: [] for w in workload},
                    tokens={w.id: [] for w in workload})
    lifespans: dict[str, tuple[float, float]] = {}
    lock = threading.Lock()

    def one(item: WorkloadRequest, start: float) -> None:
        wait_until(start, item.arrival_s)
        submitted = time.perf_counter() - start

        def on_tokens(ids: list[int]) -> None:
            t = time.perf_counter() - start
            with lock:
                run.tokens[item.id].extend(ids)
                run.token_times[item.id].extend([t] * len(ids))

        _post(port, _request(item.prompt_token_ids(vocab_size), item.max_tokens, config.prefix_caching), on_tokens)
        lifespans[item.id] = (submitted, time.perf_counter() - start)

    with PeakRss(pid) as rss, ThreadPoolExecutor(max_workers=len(workload)) as pool:
        start = time.perf_counter()
        for future in [pool.submit(one, item, start) for item in by_arrival(workload)]:
            future.result()
        run.wall_s = time.perf_counter() - start
    run.peak_rss_bytes = rss.peak
    _steps_from_stamps(run, lifespans)
    run.notes.append(f"{name}: llama.cpp {LLAMA_CPP_PYTHON_VERSION} (llama-cpp-python's), GGUF {outtype}, over HTTP; "
                     "steps and occupancy are rebuilt from token stamps (an approximation), and its RSS is the server "
                     "process's")
    return run
