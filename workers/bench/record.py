"""What a benchmark records of one system's run, and the helpers every system's runner shares.

Every system (batcher in `rqbatcher.workers.bench.run`, the peers of `python -m benchmarks.compare` from a checkout)
produces a `SystemRun`: when each token appeared, which tokens, what each step computed, and the
peak memory. `rqbatcher.workers.bench.report` then derives every metric the same way for all of them.
Arrival times in the workload are honoured: a request is submitted when its time has come.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from rqbatcher.errors import BatcherError
from rqbatcher.workers.bench.workload import WorkloadRequest

RSS_SAMPLE_INTERVAL_S = 0.02
BENCH_EXTRA = "rqbatcher[bench]"


def psutil():
    """The psutil module (peak memory), or a BatcherError naming the extra that carries it."""
    try:
        import psutil
    except ImportError:
        raise BatcherError(f"`batcher bench` measures peak memory with psutil: pip install '{BENCH_EXTRA}'") from None
    return psutil


@dataclass
class SystemRun:
    """What one system did with the workload. Times are seconds since the run started."""

    system: str
    slots: int  # sequences one step can hold
    wall_s: float = 0.0
    token_times: dict[str, list[float]] = field(default_factory=dict)  # request id -> one time per generated token
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> generated token ids
    steps: list[tuple[float, int]] = field(default_factory=list)  # (end time, sequences that did useful work)
    peak_rss_bytes: int = 0
    preemptions: int = 0
    cached_tokens: dict[str, int] | None = None  # request id -> prompt tokens found in a prefix cache, if reported
    notes: list[str] = field(default_factory=list)  # how a figure was obtained, where it is an approximation


class PeakRss:
    """Samples the resident memory of this process (or of process `pid`) in a thread: `ru_maxrss` only ever
    grows over the whole process, so it cannot tell one system's peak from the previous one's."""

    def __init__(self, pid: int | None = None) -> None:
        self._process = psutil().Process(pid)
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._process.memory_info().rss)
            if self._stop.wait(RSS_SAMPLE_INTERVAL_S):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def by_arrival(workload: list[WorkloadRequest]) -> list[WorkloadRequest]:
    return sorted(workload, key=lambda w: (w.arrival_s, w.index))


def wait_until(start: float, offset_s: float) -> None:
    """Sleep until `offset_s` seconds after `start` (a perf_counter value)."""
    delay = start + offset_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)

