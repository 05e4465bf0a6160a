"""Benchmark workload files (the format is in docs/benchmarks.md; the shared ones are bundled in workloads/).

Each line is one request: {"id": "r0", "prompt_len": 37, "max_tokens": 10, "arrival_s": 0.0}.
The prompt of the request on line i is `prompt_len` ids drawn from `random.Random(i)`, so every
system that runs a workload sees the same token ids.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from batcher.errors import BatcherError

PROMPT_ID_MARGIN = 100
BUNDLED_DIR = Path(__file__).parent / "workloads"


class WorkloadError(BatcherError, ValueError):
    """A workload file that cannot be found or read, with where and why."""


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    id: str
    prompt_len: int
    max_tokens: int
    arrival_s: float

    def prompt_token_ids(self, vocab_size: int) -> list[int]:
        rng = random.Random(self.index)
        return [rng.randrange(PROMPT_ID_MARGIN, vocab_size - PROMPT_ID_MARGIN) for _ in range(self.prompt_len)]


def bundled_workloads() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.jsonl"))


def workload_path(name_or_path: str) -> Path:
    """A file path, or the name of a bundled workload such as `skew-small`."""
    path = Path(name_or_path)
    if path.exists():
        return path
    if name_or_path in bundled_workloads():
        return BUNDLED_DIR / f"{name_or_path}.jsonl"
    raise WorkloadError(f"no workload file {name_or_path!r}; bundled: {', '.join(bundled_workloads())}")


def load_workload(name_or_path: str) -> list[WorkloadRequest]:
    path = workload_path(name_or_path)
    rows = []
    with open(path) as f:
        try:
            for index, line in enumerate(line for line in f if line.strip()):
                obj = json.loads(line)
                rows.append(WorkloadRequest(index, str(obj["id"]), int(obj["prompt_len"]), int(obj["max_tokens"]),
                                            float(obj.get("arrival_s", 0.0))))
        except (ValueError, KeyError, TypeError) as exc:
            raise WorkloadError(f"{path}: request {len(rows) + 1} is not a workload request "
                                f"(id, prompt_len, max_tokens, arrival_s): {exc!r}") from None
    return rows
