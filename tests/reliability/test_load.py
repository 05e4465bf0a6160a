"""Load: many short jobs through two worker processes on a Redis of their own. All complete; Redis
memory stays bounded (streams are trimmed and expire with their results; the peak of `INFO memory`
is recorded); queue time and throughput are reported. The queue-length limit refuses cleanly."""

from __future__ import annotations

import statistics
import time

import pytest
from rq.job import JobStatus

from rqbatcher.client import Client, QueueFull
from rqbatcher.jobs import keys
from tests.jobs_support import fake_redis_fixture, wait_for  # noqa: F401
from tests.reliability.support import MemorySampler, RedisServer, fetch, greedy, record, start_worker, stop, wait_ready

pytestmark = pytest.mark.timeout(1800)
QUEUE = "load"
RESULT_TTL_S = 15  # results, job hashes and streams expire: what Redis holds is bounded by the jobs of one TTL
PER_JOB_KB = 16  # the most Redis may hold per job still within its result TTL (measured: about 10 KB)
AFTER_EXPIRY_MB = 4  # what may remain once every result has expired (registry entries awaiting RQ's cleanup)
MAX_TOKENS = 4
BATCH = 500


def run_load(tiny_model_dir, tmp_path, n_jobs: int) -> None:
    model_dir = tiny_model_dir("llama")
    server = RedisServer(tmp_path / "redis").start()
    connection = server.connection()
    workers = [start_worker(server.url, model_dir, QUEUE, tmp_path / f"w{i}.log", max_num_seqs=32)
               for i in range(2)]
    try:
        for name, process in workers:
            wait_ready(connection, name, process)
        baseline = int(connection.info("memory")["used_memory"])
        client = Client(connection, queue=QUEUE, result_ttl=RESULT_TTL_S)
        ids: list[str] = []
        started = time.monotonic()
        with MemorySampler(connection) as memory:
            for i in range(0, n_jobs, BATCH):
                ids += client.submit_many([greedy(MAX_TOKENS, prompt_token_ids=[3 + (j % 300), 7, 11])
                                           for j in range(i, min(n_jobs, i + BATCH))])
            submitted_s = time.monotonic() - started
            results = {}
            for job_id in ids:
                results[job_id] = client.result(job_id, timeout=max(60, n_jobs / 5))
            elapsed = time.monotonic() - started
        assert all(r.usage.completion_tokens == MAX_TOKENS for r in results.values())
        assert len(results) == n_jobs
        for _, process in workers:
            assert process.poll() is None
        streams = [connection.xlen(keys.stream_key(j)) for j in ids[:50]]
        assert max(streams) <= MAX_TOKENS + 2 and all(0 < connection.ttl(keys.stream_key(j)) <= RESULT_TTL_S
                                                      for j in ids[-50:])
        peak_mb = (memory.peak - baseline) / 2**20
        assert peak_mb < n_jobs * PER_JOB_KB / 1024, peak_mb
        # Bounded: once the TTL has passed, Redis gives the memory back (streams and results expire).
        expired = wait_for(lambda: (m := int(connection.info("memory")["used_memory"])) - baseline
                           < AFTER_EXPIRY_MB * 2**20 and not list(connection.scan_iter("batcher:stream:*", count=1000))
                           and m, RESULT_TTL_S + 60, "the results and streams to expire", interval=0.5)
        queue_s = sorted(r.timings.queue_s for r in results.values())
        record(f"load_{n_jobs}", jobs=n_jobs, workers=2, completed=len(results), jobs_lost=0, seconds=f"{elapsed:.1f}",
               enqueue_seconds=f"{submitted_s:.1f}", throughput_jobs_s=f"{n_jobs / elapsed:.1f}",
               queue_s_p50=f"{statistics.median(queue_s):.2f}", queue_s_p95=f"{queue_s[int(0.95 * len(queue_s))]:.2f}",
               queue_s_max=f"{queue_s[-1]:.2f}", redis_used_memory_baseline_mb=f"{baseline / 2**20:.1f}",
               redis_peak_used_memory_mb=f"{memory.peak / 2**20:.1f}", result_ttl_s=RESULT_TTL_S,
               redis_used_memory_after_expiry_mb=f"{expired / 2**20:.1f}",
               memory_samples=memory.samples)
    finally:
        for _, process in workers:
            stop(process)
        server.stop()


def test_short_jobs_through_two_workers(tiny_model_dir, tmp_path):
    run_load(tiny_model_dir, tmp_path, 1000)


@pytest.mark.slow
def test_ten_thousand_short_jobs_through_two_workers(tiny_model_dir, tmp_path):
    run_load(tiny_model_dir, tmp_path, 10_000)


def test_the_queue_length_limit_refuses_cleanly(fake_redis):
    client = Client(fake_redis, queue="limited", max_queue_length=50)
    client.submit_many(["hi"] * 40)
    with pytest.raises(QueueFull, match="queue limited holds 40 jobs; adding 11 would pass the limit of 50"):
        client.submit_many(["hi"] * 11)
    assert fake_redis.llen("rq:queue:limited") == 40  # all or nothing
    client.submit_many(["hi"] * 10)
    with pytest.raises(QueueFull):
        client.submit("one more")
    assert fake_redis.llen("rq:queue:limited") == 50
    assert len(fake_redis.keys("rq:job:*")) == 50
    other = Client(fake_redis, queue="other").submit("x")  # the limit is per queue
    assert fetch(fake_redis, other).get_status() == JobStatus.QUEUED
