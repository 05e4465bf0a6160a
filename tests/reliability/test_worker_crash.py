"""Worker crash: three `batcher worker` processes, 60 jobs of mixed lengths, half of them enqueued with plain RQ
(no Retry), while the stock `rq info` runs in a loop; one worker is SIGKILLed
while it has at least 8 jobs in flight, a second one later. Every job ends with exactly one
successful result whose tokens equal `model.generate` alone, and a rerun job's stream starts with
`restart`. The time from each kill to the lost jobs running again is measured (goal: 30 s)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from rq import Queue
from rq.job import JobStatus
from rq.registry import FailedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from batcher.client import Client
from batcher.jobs import keys
from batcher.jobs.contract import JOB_FUNCTION
from tests.jobs_support import wait_for
from tests.reliability.support import (
    LEASE_S,
    RedisServer,
    events,
    fetch,
    greedy,
    prompt_pool,
    record,
    reference,
    start_worker,
    stop,
    wait_ready,
)

pytestmark = pytest.mark.timeout(420)
QUEUE = "crash"
RECOVERY_GOAL_S = 30
LENGTHS = (8, 24, 48, 80, 120, 160)


def in_flight(connection, ids, worker) -> list[str]:
    jobs = [fetch(connection, j) for j in ids]
    return [j.id for j in jobs if j.worker_name == worker and j.get_status() == JobStatus.STARTED
            and connection.xlen(keys.stream_key(j.id)) > 1]


def first_entry(connection, job_id):
    entries = connection.xrange(keys.stream_key(job_id), count=1)
    return entries[0] if entries else None


def kill_and_time_recovery(connection, process, ids, worker) -> tuple[list[str], float]:
    """SIGKILL `worker`; return its jobs in flight (that had begun streaming) and the seconds until all of
    them run again elsewhere."""
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = time.monotonic()
    lost = [j for j in ids if fetch(connection, j).worker_name == worker
            and fetch(connection, j).get_status() == JobStatus.STARTED]
    # A rerun replaces the stream with one that starts with `restart`: a new first entry.
    first_ids = {j: (entry[0] if (entry := first_entry(connection, j)) else None) for j in lost}

    def restarted():
        # (a job whose first attempt had not written its stream yet starts anew, without `restart`)
        return all((entry := first_entry(connection, j)) and entry[0] != first_ids[j] for j in lost)

    wait_for(restarted, RECOVERY_GOAL_S, "the killed worker's jobs to run again", interval=0.05)
    return [j for j in lost if first_ids[j]], time.monotonic() - killed_at


class StockRqInfo:
    """Runs the stock `rq info` CLI (which cleans the registries) in a loop from a thread."""

    def __init__(self, url: str, queues: list[str]) -> None:
        self.command = [sys.executable, "-m", "rq.cli", "info", "--url", url, *queues]
        self.runs = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StockRqInfo:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            done = subprocess.run(self.command, capture_output=True, text=True, timeout=60)
            self.runs += 1
            if done.returncode:
                self.failures.append(done.stdout + done.stderr)
            self._stop.wait(0.2)


def test_two_sigkilled_workers_lose_no_job_and_every_job_equals_the_reference(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    server = RedisServer(tmp_path / "redis").start()
    connection = server.connection()
    workers = [start_worker(server.url, model_dir, QUEUE, tmp_path / f"w{i}.log", max_num_seqs=16) for i in range(3)]
    rq_info = StockRqInfo(server.url, [QUEUE])
    try:
        prompts = prompt_pool()
        jobs = [(tuple(prompts[i % len(prompts)]), LENGTHS[i % len(LENGTHS)]) for i in range(60)]
        for prompt in prompts:  # while the workers load
            reference(model_dir, prompt, max(LENGTHS))
        references = {job: reference(model_dir, list(job[0]), job[1]) for job in jobs}
        for name, process in workers:
            wait_ready(connection, name, process)
        client = Client(connection, queue=QUEUE)
        plain_rq = Queue(QUEUE, connection=connection, serializer=JSONSerializer)
        # Half the jobs through plain RQ, as a backend may enqueue them: no Retry, recovered all the same.
        ids = [plain_rq.enqueue(JOB_FUNCTION, greedy(n, prompt_token_ids=list(p)).model_dump(mode="json")).id
               if i % 2 else client.submit(greedy(n, prompt_token_ids=list(p))) for i, (p, n) in enumerate(jobs)]
        by_id = dict(zip(ids, jobs))

        busiest = wait_for(lambda: next(((n, p) for n, p in workers if len(in_flight(connection, ids, n)) >= 8),
                                        None), 60, "a worker with 8 jobs streaming")
        # An operator runs the stock `rq info` over and over meanwhile: its registry cleanup must neither fail
        # nor requeue (a second time) any job of the dead worker.
        rq_info.start()
        lost1, recovery1 = kill_and_time_recovery(connection, busiest[1], ids, busiest[0])
        assert len(lost1) >= 8
        survivors = [w for w in workers if w is not busiest]
        second = wait_for(lambda: next(((n, p) for n, p in survivors if in_flight(connection, ids, n)), None),
                          30, "a surviving worker with jobs in flight")
        lost2, recovery2 = kill_and_time_recovery(connection, second[1], ids, second[0])
        assert lost2

        for job_id in ids:
            result = client.result(job_id, timeout=120)
            assert result.token_ids == references[by_id[job_id]], job_id
            results = fetch(connection, job_id).results()
            assert [r.type for r in results if r.type != Result.Type.RETRIED] == [Result.Type.SUCCESSFUL], job_id
        for job_id in set(lost1) | set(lost2):
            stream = events(connection, job_id)
            assert (stream[0].type, stream[-1].type) == ("restart", "done")
            assert len({e.execution_id for e in stream}) == 1
            assert [t for e in stream for t in e.token_ids] == references[by_id[job_id]]
        rq_info.stop()
        assert rq_info.runs > 0 and not rq_info.failures, rq_info.failures
        assert FailedJobRegistry(QUEUE, connection=connection).count == 0
        assert max(recovery1, recovery2) <= RECOVERY_GOAL_S
        record("worker_crash", jobs=len(ids), plain_rq_jobs=len(ids) // 2, rq_info_runs=rq_info.runs, jobs_lost=0,
               doubled=0,
               killed_in_flight=f"{len(lost1)}+{len(lost2)}",
               recovery_s=f"{recovery1:.1f}/{recovery2:.1f}", lease_s=LEASE_S)
    finally:
        rq_info.stop()
        for _, process in workers:
            stop(process)
        server.stop()
