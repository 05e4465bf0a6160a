"""`batcher bench` through Redis: the same workload submitted as jobs, served by a JobWorker.

The worker runs in a thread of this process on the real Redis (`--redis-url`), on a queue of its own,
and the requests are submitted at their arrival times. A token counts when a reader of the job
streams receives it, as a consumer would see it, so the figures include every Redis hop.
"""

from __future__ import annotations

import threading
import time
import uuid

from redis import Redis

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.redis_text import as_text
from rqbatcher.schema import StreamEvent
from rqbatcher.workers.bench.record import PeakRss, SystemRun, by_arrival, wait_until
from rqbatcher.workers.bench.workload import WorkloadRequest
from rqbatcher.workers.engine.engine import Engine
from rqbatcher.workers.job_worker.worker import JobWorker

READ_BLOCK_MS = 100
RESULT_TIMEOUT_S = 3600
RESULT_TTL_S = 600  # the benchmark's jobs and streams do not outstay the run for long


def _read_streams(connection: Redis, job_to_id: dict[str, str], run: SystemRun, start: float,
                  submitted: threading.Event) -> None:
    """Follow every job's stream with one XREAD, stamping tokens on receipt, until all have ended."""
    last = {keys.stream_key(job): "0-0" for job in job_to_id}
    ended: set[str] = set()
    while len(ended) < len(job_to_id) or not submitted.is_set():
        reply = connection.xread({k: v for k, v in last.items() if k not in ended}, block=READ_BLOCK_MS)
        t = time.perf_counter() - start
        for key, entries in reply or ():
            key = as_text(key)
            rid = job_to_id[key.removeprefix(keys.STREAM_PREFIX)]
            for entry_id, fields in entries:
                last[key] = entry_id
                event = StreamEvent.from_fields(fields)
                if event.type == "restart":
                    run.token_times[rid].clear()
                elif event.type == "token":
                    run.token_times[rid].extend([t] * len(event.token_ids))
                elif event.terminal:
                    ended.add(key)


def run_batcher_redis(engine: Engine, workload: list[WorkloadRequest], name: str, connection: Redis,
                      request_for) -> SystemRun:
    """Submit the workload as jobs at their arrival times to a worker thread; record what readers see."""
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    run = SystemRun(name, slots=engine.config.max_num_seqs, token_times={w.id: [] for w in workload},
                    cached_tokens={})
    client = Client(connection, queue=queue, max_queue_length=None, result_ttl=RESULT_TTL_S)
    job_to_id = {f"{queue}-{w.id}": w.id for w in workload}
    id_to_job = {v: k for k, v in job_to_id.items()}

    def on_step(worker, outputs) -> None:
        run.steps.append((time.perf_counter() - start, engine.last_step.num_seqs))
        run.preemptions += engine.last_step.num_preempted

    worker = JobWorker([queue], engine, connection=connection, name=queue, on_step=on_step)
    serving = threading.Thread(target=worker.work, kwargs={"logging_level": "WARNING"}, daemon=True)
    submitted = threading.Event()
    with PeakRss() as rss:
        start = time.perf_counter()
        serving.start()
        reader = threading.Thread(target=_read_streams, args=(connection, job_to_id, run, start, submitted),
                                  daemon=True)
        reader.start()
        for item in by_arrival(workload):
            wait_until(start, item.arrival_s)
            client.submit(request_for(item), job_id=id_to_job[item.id])
        submitted.set()
        reader.join()
        run.wall_s = time.perf_counter() - start
    run.peak_rss_bytes = rss.peak
    for job, rid in job_to_id.items():
        result = client.result(job, timeout=RESULT_TIMEOUT_S)
        run.tokens[rid], run.cached_tokens[rid] = result.token_ids, result.usage.cached_tokens
    worker.request_stop(None, None)  # drain: nothing is in flight, so it exits at once
    serving.join()
    connection.delete(*(keys.stream_key(job) for job in job_to_id))
    return run
