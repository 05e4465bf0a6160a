"""Helpers for the reliability suite: private redis-server processes, real `batcher worker`
processes, references, and a peak-memory sampler.

Every test here talks to a Redis server it started itself on a free loopback port, so it may
flush, restart or starve it without touching anyone else's data.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from rqbatcher.jobs import keys
from rqbatcher.schema import GenerationRequest, SamplingParams, StreamEvent
from tests.e2e.test_workers import stop, wait_ready  # noqa: F401  (re-exported: the e2e helpers)

REPO = Path(__file__).resolve().parents[2]
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
LEASE_S = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server of our own: loopback only, its own directory, stopped and restarted at will."""

    def __init__(self, directory: Path, *args: str, port: int | None = None, password: str | None = None,
                 scheme: str = "redis", client_kwargs: dict | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = list(args)
        self.password = password
        self.scheme = scheme
        self.client_kwargs = client_kwargs or {}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{self.scheme}://{auth}127.0.0.1:{self.port}/0"

    def connection(self, **kwargs) -> Redis:
        return Redis.from_url(self.url, **{**self.client_kwargs, **kwargs})

    def start(self, wait: bool = True) -> RedisServer:
        command = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
                   "--save", "", "--protected-mode", "yes", *self.args]
        log = (self.directory / "redis.log").open("a")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_up()
        return self

    def wait_up(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"redis-server exited: {(self.directory / 'redis.log').read_text()}"
            try:
                if self.connection(retry=None, socket_connect_timeout=0.5).ping():
                    return
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM is a clean shutdown (the AOF is flushed); SIGKILL a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(30)
        self.process = None


def start_worker(url: str, model_dir: Path, queue: str, log_path: Path, *, max_num_seqs: int = 16,
                 num_blocks: int = 512, lease: int = LEASE_S, extra: tuple[str, ...] = (),
                 module: str = "rqbatcher", name: str | None = None) -> tuple[str, subprocess.Popen]:
    """A real worker process (`python -m rqbatcher worker ...`, or a wrapper module taking the same args)."""
    name = name or f"rel-{uuid.uuid4().hex[:8]}"
    command = [sys.executable, "-m", module, "worker", "--redis-url", url, "--queue", queue,
               "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-blocks", str(num_blocks),
               "--max-num-seqs", str(max_num_seqs), "--lease", str(lease), "--name", name, *extra]
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    return name, process


def greedy(max_tokens: int, **request) -> GenerationRequest:
    return GenerationRequest(sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), **request)


def events(connection: Redis, job_id: str) -> list[StreamEvent]:
    return [StreamEvent.from_fields(f) for _, f in connection.xrange(keys.stream_key(job_id))]


def fetch(connection: Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=connection, serializer=JSONSerializer)


class MemorySampler:
    """Samples `INFO memory` used_memory in a thread; `peak` is the largest value seen (bytes)."""

    def __init__(self, connection: Redis, interval: float = 0.25) -> None:
        self.connection, self.interval = connection, interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, int(self.connection.info("memory")["used_memory"]))
                self.samples += 1
            except Exception:  # noqa: BLE001  (a restart in progress)
                pass
            self._stop.wait(self.interval)


def record(name: str, **figures) -> None:
    """Print one line of figures for docs/reliability.md (shown with `pytest -s`, kept in the report)."""
    line = f"RELIABILITY {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items())
    print(line)
    out = os.environ.get("BATCHER_RELIABILITY_FIGURES")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def prompt_pool(n: int = 12, seed: int = 5) -> list[list[int]]:
    """The prompts (token ids) the suite's jobs use, so their references are computed once per session."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 381) for _ in range(rng.randint(2, 16))] for _ in range(n)]


_generated: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def reference(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """`model.generate` alone (tests.engine_helpers.reference_tokens), greedy and without EOS; a longer
    generation of the same prompt is reused, since greedy decoding's first n tokens do not depend on
    how many follow."""
    import torch

    from tests.engine_helpers import reference_tokens

    key = (str(model_dir), tuple(prompt_ids))
    if len(_generated.get(key, ())) < max_tokens:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matmuls on shared cores: spinning OpenMP threads only slow them
        try:
            _generated[key] = reference_tokens(model_dir, list(prompt_ids), max_tokens)
        finally:
            torch.set_num_threads(threads)
    return _generated[key][:max_tokens]
