"""A `batcher worker` process for a serving benchmark, on CPU: shared by mixed_load, serving and
scheduling_matrix, so that each measures the same worker started the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def worker_env(threads: int, src: Path | None = None) -> dict:
    """The environment of a worker of this tree (or of the checkout `src`) with `threads` torch threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


def start_worker(redis_url: str, queue: str, model: str, dtype: str, threads: int, slots: int, log: Path,
                 *extra: str, src: Path | None = None) -> subprocess.Popen:
    """A worker on `queue` with `slots` slots; `extra` are more of its options (a step policy, a served name)."""
    return subprocess.Popen([sys.executable, "-m", "rqbatcher", "worker", "--redis-url", redis_url, "--queue", queue,
                             "--model", model, "--dtype", dtype, "--device", "cpu", "--max-num-seqs", str(slots),
                             *extra], env=worker_env(threads, src), stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), cwd=src)
