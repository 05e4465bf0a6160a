"""Benchmark workload files (the format is in docs/benchmarks.md; the shared ones are bundled in workloads/).

Each line is one request: {"id": "r0", "prompt_len": 37, "max_tokens": 10, "arrival_s": 0.0}.
The prompt of the request on line i is `prompt_len` ids drawn from `random.Random(i)`, so every
system that runs a workload sees the same token ids. A line may also name a shared prefix,
{"prefix_id": "d3", "prefix_len": 1024}: then its first `prefix_len` ids are drawn from
`random.Random("prefix:" + prefix_id)`, the same on every line with that prefix_id, and the remaining
`prompt_len - prefix_len` from `random.Random(i)`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from rqbatcher.errors import BatcherError

PROMPT_ID_MARGIN = 100
PREFIX_SEED_PREFIX = "prefix:"
BUNDLED_DIR = Path(__file__).parent / "workloads"


class WorkloadError(BatcherError, ValueError):
    """A workload file that cannot be found or read, with where and why."""


def _draw(seed: int | str, n: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(PROMPT_ID_MARGIN, vocab_size - PROMPT_ID_MARGIN) for _ in range(n)]


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    id: str
    prompt_len: int
    max_tokens: int
    arrival_s: float
    prefix_id: str | None = None
    prefix_len: int = 0

    def prompt_token_ids(self, vocab_size: int) -> list[int]:
        prefix = _draw(PREFIX_SEED_PREFIX + self.prefix_id, self.prefix_len, vocab_size) if self.prefix_id else []
        return prefix + _draw(self.index, self.prompt_len - self.prefix_len, vocab_size)


def shared_prefix_lengths(workload: list[WorkloadRequest]) -> dict[str, int]:
    """Request id -> the prompt tokens a perfect prefix cache would not compute: its prefix, unless it is
    the first request (by arrival) to ask for it."""
    seen: set[str] = set()
    shared = {}
    for item in sorted(workload, key=lambda w: (w.arrival_s, w.index)):
        shared[item.id] = item.prefix_len if item.prefix_id in seen else 0
        if item.prefix_id is not None:
            seen.add(item.prefix_id)
    return shared


def shared_prefix_tokens(workload: list[WorkloadRequest]) -> int:
    """Prompt tokens a perfect prefix cache would not compute, in all."""
    return sum(shared_prefix_lengths(workload).values())


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


def _request(index: int, obj: dict) -> WorkloadRequest:
    prefix_id, prefix_len = obj.get("prefix_id"), obj.get("prefix_len")
    if (prefix_id is None) != (prefix_len is None):
        raise ValueError("prefix_id and prefix_len go together")
    item = WorkloadRequest(index, str(obj["id"]), int(obj["prompt_len"]), int(obj["max_tokens"]),
                           float(obj.get("arrival_s", 0.0)), None if prefix_id is None else str(prefix_id),
                           int(prefix_len or 0))
    if not 0 <= item.prefix_len <= item.prompt_len:
        raise ValueError(f"prefix_len must be between 0 and prompt_len ({item.prompt_len}), got {item.prefix_len}")
    return item


def load_workload(name_or_path: str) -> list[WorkloadRequest]:
    """The requests of a workload file; WorkloadError names the request of a malformed line."""
    path = workload_path(name_or_path)
    rows = []
    with open(path) as f:
        for index, line in enumerate(line for line in f if line.strip()):
            try:
                rows.append(_request(index, json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                reason = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
                raise WorkloadError(f"{path}: request {index + 1} is not a workload request: {reason}") from None
    return rows
