"""What the job system costs per job: jobs per second through one in-process worker, with no model.

    python -m benchmarks.job_rate --jobs 2000 --rounds 3

Runs against a redis-server of its own (`benchmarks.private_redis`). Each round enqueues `--jobs`
requests of `--tokens` tokens in one pipeline, then one worker serves them in burst mode on the letter engine
(`tests.letter_engine`): every Redis command of a job's life (take, start under a lease, stream events,
fenced end, result, feed) runs as in production; only the model is missing.
"""

from __future__ import annotations

import time

import click
from redis import Redis

from benchmarks.private_redis import private_redis
from rqbatcher.client import Client
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.letter_engine import LetterEngine

QUEUE = "job-rate"


def rate(connection: Redis, jobs: int, tokens: int, slots: int) -> float:
    """Jobs per second of one burst of `jobs`, from the worker's start to its last job's end (the worker's exit
    waits about a second for RQ's command thread, which is no job's cost)."""
    connection.flushdb()
    request = GenerationRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=tokens))
    Client(connection, queue=QUEUE, max_queue_length=None).submit_many([request] * jobs)
    ends: list[float] = []
    worker = JobWorker([QUEUE], LetterEngine(max_num_seqs=slots), connection=connection,
                       on_job_end=lambda _worker, _end: ends.append(time.perf_counter()))
    started = time.perf_counter()
    worker.work(burst=True)
    return jobs / (ends[-1] - started)


@click.command()
@click.option("--jobs", type=click.IntRange(1), default=2000, show_default=True)
@click.option("--tokens", type=click.IntRange(1), default=4, show_default=True, help="Tokens per job.")
@click.option("--slots", type=click.IntRange(1), default=32, show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
def main(jobs: int, tokens: int, slots: int, rounds: int) -> None:
    with private_redis() as connection:
        rates = [rate(connection, jobs, tokens, slots) for _ in range(rounds)]
    click.echo(f"{jobs} jobs of {tokens} tokens, {slots} slots: " + ", ".join(f"{r:.0f}" for r in rates)
               + f" jobs/s (best {max(rates):.0f})")


if __name__ == "__main__":
    main()
