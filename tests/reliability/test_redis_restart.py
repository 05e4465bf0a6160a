"""Redis faults: the workers start before their Redis does (they wait, with a clear log line), then
Redis (AOF, appendfsync everysec) is restarted in the middle of a run and stays down longer than
redis-py's own retries last. Workers and clients ride it out with backoff: no process exits, no
busy spin, and every job completes once, with the reference tokens."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
from rq.job import JobStatus
from rq.results import Result

from rqbatcher.client import Client
from tests.jobs_support import wait_for
from tests.reliability.support import (
    RedisServer,
    fetch,
    free_port,
    greedy,
    prompt_pool,
    record,
    reference,
    start_worker,
    stop,
    wait_ready,
)

pytestmark = pytest.mark.timeout(420)
QUEUE = "restart"
DOWN_S = 8  # longer than redis-py's own retries (about 4.5 s): the worker's own backoff has to cope
LENGTHS = (16, 48, 96, 160)
UNREACHABLE = re.compile(r"cannot reach Redis at 127\.0\.0\.1:\d+ .*; retrying in [\d.]+ s")
BACKING_OFF = re.compile(r"Redis unreachable .*; retrying in [\d.]+ s")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks (USER_HZ = 100)


def test_workers_wait_for_redis_then_ride_out_a_restart_and_lose_no_job(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    server = RedisServer(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "everysec", port=free_port())
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = [start_worker(server.url, model_dir, QUEUE, log) for log in logs]
    try:
        # 1. No Redis yet: each worker says so, and retries.
        for log, (_, process) in zip(logs, workers):
            wait_for(lambda: UNREACHABLE.search(log.read_text()), 120, "the worker to report Redis unreachable",
                     interval=0.2)
            assert process.poll() is None
        server.start()
        connection = server.connection()
        for name, process in workers:
            wait_ready(connection, name, process)

        # 2. A run, with Redis restarted in the middle of it.
        prompts = prompt_pool()
        jobs = [(tuple(prompts[i % len(prompts)]), LENGTHS[i % len(LENGTHS)]) for i in range(40)]
        client = Client(server.url, queue=QUEUE)
        ids = client.submit_many([greedy(n, prompt_token_ids=list(p)) for p, n in jobs])
        results: dict[str, object] = {}

        def wait_all():  # a client waiting through the outage
            for job_id in ids:
                try:
                    results[job_id] = client.result(job_id, timeout=180)
                except Exception as exc:  # noqa: BLE001
                    results[job_id] = exc

        waiter = threading.Thread(target=wait_all)
        waiter.start()
        wait_for(lambda: sum(fetch(connection, j).get_status() == JobStatus.FINISHED for j in ids) >= 4, 120,
                 "the first jobs to finish", interval=0.1)
        in_flight_before = sum(fetch(connection, j).get_status() == JobStatus.STARTED for j in ids)
        cpu_before = [cpu_seconds(p.pid) for _, p in workers]
        down_at = time.monotonic()
        server.stop()
        time.sleep(DOWN_S)
        cpu_down = [cpu_seconds(p.pid) - c for (_, p), c in zip(workers, cpu_before)]
        server.start()
        up_at = time.monotonic()
        for job_id in ids:
            reference(model_dir, list(jobs[ids.index(job_id)][0]), max(LENGTHS))
        waiter.join(240)
        assert not waiter.is_alive()
        completed_s = time.monotonic() - up_at

        for (name, process), log in zip(workers, logs):
            assert process.poll() is None, f"worker {name} exited: {log.read_text()[-2000:]}"
        for job_id, (prompt, n) in zip(ids, jobs):
            result = results[job_id]
            assert not isinstance(result, Exception), f"{job_id}: {result!r}"
            assert result.token_ids == reference(model_dir, list(prompt), n), job_id
            types = [r.type for r in fetch(connection, job_id).results()]
            assert [t for t in types if t != Result.Type.RETRIED] == [Result.Type.SUCCESSFUL], job_id
        # Backoff, not a busy loop: little CPU while Redis was away, and a handful of retry lines.
        assert max(cpu_down) < 0.5 * DOWN_S, cpu_down
        retries = [len(BACKING_OFF.findall(log.read_text())) for log in logs]
        assert max(retries) <= 2 * DOWN_S, retries
        record("redis_restart", jobs=len(ids), jobs_lost=0, in_flight_at_stop=in_flight_before, down_s=DOWN_S,
               all_done_after_restart_s=f"{completed_s:.1f}",
               worker_cpu_while_down_s="/".join(f"{c:.2f}" for c in cpu_down),
               retry_log_lines="/".join(map(str, retries)))
        assert down_at < up_at
    finally:
        for _, process in workers:
            stop(process)
        server.stop()
