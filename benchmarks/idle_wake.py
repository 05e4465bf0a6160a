"""How long a plain RQ producer's job waits on an idle worker, for each kind of the worker's queues.

    python -m benchmarks.idle_wake --jobs 20

Runs against a redis-server of its own (`benchmarks.private_redis`) and one in-process worker on the letter engine
(`tests.letter_engine`, no model). Each job is enqueued with plain RQ (`Queue(name, serializer=JSONSerializer)`),
which touches none of batcher's keys, at a random moment after the previous one ended, so it finds the worker idle
in its wait; its queue time is RQ's `started_at - enqueued_at`. The worker's queues: its first (`idle-wake`), its
second (`idle-wake.p1`) and a priority-class queue (`idle-wake.priority`, registered by one request through the
client first). Before the worker polled every queue, it blocked on its first queue alone for up to IDLE_WAIT_S (1 s),
so a job on any other queue waited for the end of that block; `--poll-s 1` shows a poll that slow.
"""

from __future__ import annotations

import random
import statistics
import threading
import time

import click

from benchmarks.private_redis import private_redis
from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.contract import JOB_FUNCTION
from rqbatcher.jobs.queues import class_queue
from rqbatcher.jobs.rq_adapter import Job, JobStatus, rq_queue
from rqbatcher.schema import GenerationRequest
from rqbatcher.service_class import PRIORITY
from rqbatcher.workers.job_worker import admission
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.letter_engine import LetterEngine

QUEUE = "idle-wake"
MAX_ARRIVAL_DELAY_S = 0.3  # a job arrives this long at most after the previous one ended, at random
JOB_TIMEOUT_S = 10.0
SEED = 0


def queue_time(connection, queue: str) -> float:
    """Enqueue one plain RQ job on `queue` and return its seconds in the queue, once it has ended."""
    job = rq_queue(queue, connection).enqueue(JOB_FUNCTION, {"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 1}})
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while job.get_status(refresh=True) != JobStatus.FINISHED:
        if time.monotonic() > deadline:
            raise click.ClickException(f"job {job.id} on {queue} did not finish in {JOB_TIMEOUT_S} s")
        time.sleep(0.01)
    job = Job.fetch(job.id, connection=connection, serializer=job.serializer)
    return (job.started_at - job.enqueued_at).total_seconds()


@click.command()
@click.option("--jobs", type=click.IntRange(1), default=20, show_default=True, help="Jobs per queue.")
@click.option("--poll-s", type=click.FloatRange(0.001), default=admission.IDLE_POLL_S, show_default=True,
              help="The idle worker's poll of its other queues.")
def main(jobs: int, poll_s: float) -> None:
    admission.IDLE_POLL_S = poll_s
    rng = random.Random(SEED)
    with private_redis() as connection:
        client = Client(connection, queue=QUEUE)
        client.submit(GenerationRequest(prompt_token_ids=[1], service_class=PRIORITY))  # registers its queue
        worker = JobWorker(keys.priority_queue_names([QUEUE]), LetterEngine(), connection=connection)
        runner = threading.Thread(target=worker.work, daemon=True)
        runner.start()
        queues = {"first": QUEUE, "second": keys.queue_name(QUEUE, 1), "priority": class_queue(QUEUE, PRIORITY, 0)}
        for kind, queue in queues.items():
            times = []
            for _ in range(jobs):
                time.sleep(rng.uniform(0, MAX_ARRIVAL_DELAY_S))
                times.append(queue_time(connection, queue))
            click.echo(f"{kind:>8} ({queue}): queue time p50 {statistics.median(times) * 1000:.1f} ms, "
                       f"max {max(times) * 1000:.1f} ms over {jobs} jobs (poll {poll_s} s)")
        worker.mark_draining()
        runner.join()


if __name__ == "__main__":
    main()
