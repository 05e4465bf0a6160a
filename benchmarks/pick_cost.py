"""What one fair pick (`rqbatcher.jobs.fairness.Picker`) costs on a redis-server of the bench's own.

    python -m benchmarks.pick_cost [--repeats 100]

Each case fills a shared queue as the enqueue leaves it (its jobs noted per tenant, or none for plain RQ), then
times one pick; prints the median and p90 in milliseconds.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import click
from redis import Redis

from benchmarks.gateway_cost import stop_all
from benchmarks.private_redis import start_redis_server
from rqbatcher.jobs import fairness, keys
from rqbatcher.jobs.fairness import Candidate, Picker
from rqbatcher.schema import GenerationRequest

QUEUE = "pick"
CASES = (("32 of 1000 jobs, 4 tenants", 1000, 4, 32), ("1 of 1000 jobs, 4 tenants", 1000, 4, 1),
         ("32 of 1000 jobs, no tenant (plain RQ)", 1000, 0, 32), ("an empty queue", 0, 0, 32))


def _fill(connection: Redis, jobs: int, tenants: int) -> None:
    connection.flushdb()
    ids = [f"j{i}" for i in range(jobs)]
    if ids:
        connection.rpush(f"rq:queue:{QUEUE}", *ids)
    if tenants:
        with connection.pipeline() as pipe:
            fairness.note_on(pipe, QUEUE, [(QUEUE, GenerationRequest(prompt="x", tenant=f"t{i % tenants}"), job)
                                           for i, job in enumerate(ids)], 3600)
            pipe.execute()


def run(repeats: int) -> dict:
    directory = tempfile.mkdtemp(prefix="bench-pick-")
    server, url = start_redis_server(directory)
    try:
        connection = Redis.from_url(url)
        picker = Picker(connection)
        candidate = Candidate(f"rq:queue:{QUEUE}", f"rq:intermediate:{QUEUE}", keys.fairness_key(QUEUE, "interactive"),
                              keys.job_tenants_key(QUEUE), keys.due_key(QUEUE), keys.waiting_tenants_key(QUEUE),
                              0, False, fairness.NO_TENANT)
        report = {}
        for label, jobs, tenants, free in CASES:
            times = []
            for _ in range(repeats):
                _fill(connection, jobs, tenants)
                started = time.perf_counter()
                picker.pick([candidate], free)
                times.append(time.perf_counter() - started)
            times.sort()
            report[label] = {"median_ms": round(statistics.median(times) * 1e3, 3),
                             "p90_ms": round(times[int(0.9 * len(times))] * 1e3, 3)}
        return report
    finally:
        stop_all([server], directory, keep_logs=False)


@click.command()
@click.option("--repeats", type=click.IntRange(10), default=100, show_default=True)
def main(repeats):
    """Time one fair pick in a few queue shapes; print JSON."""
    click.echo(json.dumps(run(repeats), indent=1))


if __name__ == "__main__":
    main()
