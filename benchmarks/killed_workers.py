"""Real `batcher worker` processes on a redis-server of their own, SIGKILLed mid-generation, and what their
jobs' streams show: the part of `benchmarks.resume_after_crash` that starts, watches and kills
workers."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.worker import Worker

from benchmarks.gateway_cost import _wait, stop_all
from benchmarks.private_redis import start_redis_server
from rqbatcher.jobs import keys
from rqbatcher.schema import StreamEvent

LEASE_S = 2  # a dead worker's jobs run again this long after the kill (plus a keeper tick: a third of it)
SLOTS = 16  # --max-num-seqs of every worker, the reference's included
READY_S = 300  # a worker loads torch and the model on a busy machine
RESULT_TIMEOUT_S = 1800
POLL_S = 0.05  # how often the bench looks at the jobs and their streams


# ----- workers and streams -----
@dataclass
class Bench:
    """The bench's redis-server and worker processes, in one folder (their logs)."""

    model: str
    dtype: str
    threads: int
    keep_logs: bool
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-resume-")))
    processes: list[subprocess.Popen] = field(default_factory=list)
    url: str = ""

    def __enter__(self) -> Bench:
        server, self.url = start_redis_server(self.directory)
        self.processes.append(server)
        return self

    def __exit__(self, *exc) -> None:
        stop_all(self.processes, self.directory, self.keep_logs)

    @property
    def connection(self) -> Redis:
        return Redis.from_url(self.url)

    def start_worker(self, queue: str) -> tuple[str, subprocess.Popen]:
        """A `batcher worker` process serving `queue` (not waited for: see `wait_ready`)."""
        name = f"resume-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "TOKENIZERS_PARALLELISM": "false"}
        process = subprocess.Popen(
            [sys.executable, "-m", "rqbatcher", "worker", "--redis-url", self.url, "--queue", queue, "--model",
             self.model, "--dtype", self.dtype, "--device", "cpu", "--max-num-seqs", str(SLOTS),
             "--lease", str(LEASE_S), "--name", name],
            env=env, stdout=subprocess.DEVNULL, stderr=(self.directory / f"{name}.log").open("w"))
        self.processes.append(process)
        return name, process

    def wait_ready(self, name: str, process: subprocess.Popen) -> None:
        connection = self.connection

        def registered() -> bool:
            assert process.poll() is None, (self.directory / f"{name}.log").read_text()[-2000:]
            return bool(connection.exists(Worker.redis_worker_namespace_prefix + name))

        _wait(registered, READY_S, f"worker {name}")


def events(connection: Redis, job_id: str) -> list[StreamEvent]:
    return [StreamEvent.from_fields(f) for _, f in connection.xrange(keys.stream_key(job_id))]


def joined_text(stream: list[StreamEvent]) -> str:
    """The text a reader of the stream shows: the token deltas joined, started over at each `restart`."""
    text: list[str] = []
    for event in stream:
        if event.type == "restart":
            text = []
        elif event.type == "token":
            text.append(event.text)
    return "".join(text)


def kill(process: subprocess.Popen) -> float:
    """SIGKILL a worker: a crash. Returns when it was sent (time.monotonic)."""
    killed_at = time.monotonic()
    process.send_signal(signal.SIGKILL)
    process.wait()
    return killed_at


class StreamWatcher(threading.Thread):
    """Reads the jobs' streams as they are written (XREAD), noting when each event arrived: the arrival of an
    execution's last write before a kill is how long its worker had run since it last flushed."""

    def __init__(self, url: str, job_ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.connection = Redis.from_url(url)
        self.positions = {keys.stream_key(j): "0-0" for j in job_ids}
        self.job_of = {keys.stream_key(j): j for j in job_ids}
        self.arrivals: dict[str, list[tuple[float, StreamEvent]]] = {j: [] for j in job_ids}  # by job
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            for key, entries in self.connection.xread(self.positions, block=int(POLL_S * 1000)):
                at = time.monotonic()
                key = key.decode()
                self.positions[key] = entries[-1][0]
                self.arrivals[self.job_of[key]] += [(at, StreamEvent.from_fields(f)) for _, f in entries]

    def stop(self) -> None:
        self._stopping.set()
        self.join()


# ----- crash -----
def streaming_on(connection: Redis, job_ids: list[str]) -> dict[str, list[str]]:
    """The jobs started and streaming tokens, by worker."""
    by_worker: dict[str, list[str]] = {}
    for job in Job.fetch_many(job_ids, connection=connection, serializer=JSONSerializer):
        if job is not None and job.get_status(refresh=False) == JobStatus.STARTED and job.worker_name \
                and connection.xlen(keys.stream_key(job.id)) > 1:
            by_worker.setdefault(job.worker_name, []).append(job.id)
    return by_worker


def wait_for(predicate, timeout: float, what: str, interval: float = POLL_S):
    """Poll `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout} s")
        time.sleep(interval)
    return value


@dataclass
class Kill:
    """One SIGKILLed worker: when, and the executions it had streaming (job id -> execution id)."""

    worker: str
    at: float
    executions: dict[str, str]


def kill_busiest(connection: Redis, workers: dict[str, subprocess.Popen], job_ids: list[str],
                 at_least: int) -> Kill:
    """Wait for a worker with `at_least` jobs streaming, SIGKILL the one with the most, and note its executions."""
    busy = wait_for(lambda: {w: j for w, j in streaming_on(connection, job_ids).items()
                             if w in workers and len(j) >= at_least}, RESULT_TIMEOUT_S,
                    f"worker with {at_least} jobs streaming")
    name = max(busy, key=lambda w: len(busy[w]))
    at = kill(workers.pop(name))
    executions = {}
    for job in Job.fetch_many(job_ids, connection=connection, serializer=JSONSerializer):
        if job.worker_name == name and job.get_status(refresh=False) == JobStatus.STARTED:
            stream = events(connection, job.id)
            if stream:  # the execution of its last `start`: the dead one
                executions[job.id] = next(e.execution_id for e in reversed(stream) if e.type in ("start", "restart"))
    return Kill(name, at, executions)


def rerun(connection: Redis, kill_: Kill) -> bool:
    """Whether every job of the killed worker runs again (a newer execution wrote its `start`)."""
    for job_id, execution in kill_.executions.items():
        stream = events(connection, job_id)
        starts = [e.execution_id for e in stream if e.type in ("start", "restart")]
        if execution in starts and starts[-1] == execution:
            return False
    return True


def regenerated(watcher: StreamWatcher, kill_: Kill) -> tuple[int, int]:
    """Tokens the dead executions generated but never wrote, as (estimate, bound).

    The worker writes each step's tokens after the step, once STREAM_FLUSH_S has passed since its last write, so
    what a SIGKILL loses is the tokens since that write: its step in progress, and at most one flush window.
    - bound: per dead execution, the most tokens any one of its writes held (a flush window's worth), plus one
      for the step in progress;
    - estimate: per dead execution, the time from its last write's arrival to the kill, times its token rate over
      its writes (tokens over the time from its first write's arrival to its last), rounded up, and no more than
      its bound. The arrivals are this process's reads, late by its own scheduling."""
    estimate = bound = 0
    for job_id, execution in kill_.executions.items():
        writes = [(at, e) for at, e in watcher.arrivals[job_id] if e.execution_id == execution and e.type == "token"]
        if not writes:
            bound += 1
            estimate += 1
            continue
        most = max(len(e.token_ids) for _, e in writes) + 1
        first, last = writes[0][0], min(writes[-1][0], kill_.at)
        tokens = sum(len(e.token_ids) for _, e in writes[1:])
        rate = tokens / (last - first) if last > first else 0.0
        bound += most
        estimate += min(most, math.ceil(rate * (kill_.at - last)))
    return estimate, bound


def kept(stream: list[StreamEvent]) -> int:
    """Tokens that executions before the last one streamed: what the rerun went on from (a restart would make them
    again)."""
    last = stream[-1].execution_id
    return sum(len(e.token_ids) for e in stream if e.type == "token" and e.execution_id != last)


def resumed_at(stream: list[StreamEvent]) -> list[int]:
    """The token positions where a later execution took the stream over (one per rerun)."""
    positions, tokens = [], 0
    for event in stream:
        if event.type == "start" and tokens:
            positions.append(tokens)
        tokens += len(event.token_ids) if event.type == "token" else 0
    return positions
