"""What a large batch costs Redis: submit time, memory per queued request, and the cost of the counts.

    python -m benchmarks.batch_redis_cost --lines 10000

Runs against a redis-server of its own (`benchmarks.private_redis`), so the memory figures hold nothing else. No
model runs: each job's end is recorded the way the worker does it, one MULTI transaction per job, with and without
its batch outcome (`rqbatcher.batches.lines.record_outcome_on`), so the difference is the cost of the counts, the lines
and the feed entries.
"""

from __future__ import annotations

import json
import time

import click
from redis import Redis
from redis.connection import Connection
from rq.job import Job
from rq.serializers import JSONSerializer

from benchmarks.private_redis import private_redis
from rqbatcher.batches.lines import record_outcome_on
from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.life import decode_request
from rqbatcher.schema import GenerationRequest, GenerationResult, Usage

PROMPT_WORDS = 40  # about 250 bytes of prompt per line
MAX_TOKENS = 64
RESULT_TOKENS = 64


def _batch_lines(n: int) -> list[str]:
    words = "the queue holds every request of the batch until a worker takes it".split()
    return [json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "smollm2", "max_tokens": MAX_TOKENS, "messages": [
                            {"role": "user", "content": " ".join(words[(i + k) % len(words)]
                                                                 for k in range(PROMPT_WORDS))}]}})
            for i in range(n)]


def _used_memory(connection: Redis) -> int:
    return int(connection.info("memory")["used_memory"])


def _commands(connection: Redis) -> int:
    return int(connection.info("stats")["total_commands_processed"])


class _RoundTrips:
    """Counts the requests sent to Redis (a pipeline's whole transaction is one)."""

    def __init__(self) -> None:
        self.count = 0
        self._send = Connection.send_packed_command

    def __enter__(self) -> _RoundTrips:
        def counting(connection, command, check_health=True):
            self.count += 1
            return self._send(connection, command, check_health)

        Connection.send_packed_command = counting
        return self

    def __exit__(self, *exc) -> None:
        Connection.send_packed_command = self._send


def _record_all(connection: Redis, batch_id: str, requests: list[GenerationRequest], result: GenerationResult,
                with_batch: bool) -> tuple[float, int]:
    """Record every job's end, one transaction per job as the worker does; return (seconds, round trips)."""
    with _RoundTrips() as trips:
        seconds = _record_each(connection, batch_id, requests, result, with_batch)
    return seconds, trips.count


def _record_each(connection: Redis, batch_id: str, requests: list[GenerationRequest], result: GenerationResult,
                 with_batch: bool) -> float:
    started = time.perf_counter()
    for i, request in enumerate(requests):
        job_id = keys.batch_job_id(batch_id, i)
        with connection.pipeline() as pipe:
            pipe.multi()
            pipe.hset(f"bench:result:{job_id}", mapping={"status": "finished", "return_value": "..."})
            if with_batch:
                record_outcome_on(pipe, job_id=job_id, queue="bench", status="finished", request=request, result=result)
            pipe.execute()
    return time.perf_counter() - started


def run(lines: int) -> dict:
    with private_redis() as connection:
        client = Client(connection, queue="bench", max_queue_length=None)
        text = _batch_lines(lines)
        file_bytes = sum(len(line) + 1 for line in text)
        before_memory, before_commands = _used_memory(connection), _commands(connection)
        started = time.perf_counter()
        batch = client.create_batch(iter(text))
        submit_s = time.perf_counter() - started
        queued_memory = _used_memory(connection) - before_memory
        submit_commands = _commands(connection) - before_commands

        jobs = Job.fetch_many([keys.batch_job_id(batch.id, i) for i in range(lines)], connection,
                              serializer=JSONSerializer)
        requests = [decode_request(job) for job in jobs]
        result = GenerationResult(text="word " * RESULT_TOKENS, token_ids=list(range(RESULT_TOKENS)),
                                  finish_reason="length",
                                  usage=Usage(prompt_tokens=60, completion_tokens=RESULT_TOKENS), model="smollm2")
        connection.config_resetstat()
        plain_s, plain_trips = _record_all(connection, batch.id, requests, result, with_batch=False)
        before_memory = _used_memory(connection)
        counted_s, counted_trips = _record_all(connection, batch.id, requests, result, with_batch=True)
        lines_memory = _used_memory(connection) - before_memory  # minus the plain results, written already
        stats = connection.info("commandstats")
        script = stats.get("cmdstat_eval", {})
        ended = client.batch(batch.id)
        started = time.perf_counter()
        output_bytes = sum(len(line) for line in client.batch_output(batch.id))
        render_s = time.perf_counter() - started
        return {
            "lines": lines, "file_mib": round(file_bytes / 2**20, 2),
            "submit_s": round(submit_s, 3), "submit_lines_per_s": round(lines / submit_s),
            "submit_redis_commands_per_line": round(submit_commands / lines, 2),
            "queued_bytes_per_request": round(queued_memory / lines),
            "record_plain_us_per_job": round(plain_s / lines * 1e6, 1),
            "record_with_counts_us_per_job": round(counted_s / lines * 1e6, 1),
            "round_trips_per_job_plain": plain_trips / lines, "round_trips_per_job_with_counts": counted_trips / lines,
            "counts_redis_us_per_job": script.get("usec_per_call"),
            "stored_line_bytes_per_request": round(lines_memory / lines),
            "status": ended.status, "completed": ended.request_counts.completed,
            "output_mib": round(output_bytes / 2**20, 2), "render_output_s": round(render_s, 3),
        }


@click.command()
@click.option("--lines", type=click.IntRange(1), default=10_000, show_default=True)
def main(lines: int) -> None:
    """Measure a batch of LINES requests on a private redis-server; print JSON."""
    click.echo(json.dumps(run(lines), indent=1))


if __name__ == "__main__":
    main()
