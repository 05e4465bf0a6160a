"""Commands for jobs on Redis: `worker`, `submit`, `tail`, `status`, `cancel`."""

from __future__ import annotations

import json
import sys

import click

from batcher import keys
from batcher.cli import main
from batcher.cli.options import engine_options, queue_option, redis_url_option
from batcher.config import DEFAULT_METRICS_ADDR
from batcher.jobs import DEFAULT_LEASE_S


def _client(redis_url: str, queue: str = keys.DEFAULT_QUEUE):
    from batcher.client import Client

    return Client(redis_url, queue=queue)


@main.command()
@redis_url_option
@click.option("--queue", "queues", multiple=True, default=[keys.DEFAULT_QUEUE], envvar="BATCHER_QUEUE",
              show_default=True, help="A queue to serve; repeat it, most urgent first. Each queue's priority "
                                      "levels 0-9 are served in order.")
@engine_options
@click.option("--name", envvar="BATCHER_WORKER_NAME", help="The worker's name in RQ (default: a random id).")
@click.option("--lease", type=click.IntRange(1), default=DEFAULT_LEASE_S, envvar="BATCHER_LEASE_S", show_default=True,
              help="Seconds a job's lease lasts without a heartbeat: how soon a dead worker's jobs "
                               "are retried.")
@click.option("--burst", is_flag=True, help="Exit once the queues are empty and no job is in flight.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), envvar="BATCHER_METRICS_PORT",
              help="Serve Prometheus metrics on this port (off when not given).")
@click.option("--metrics-addr", default=DEFAULT_METRICS_ADDR, envvar="BATCHER_METRICS_ADDR", show_default=True,
              help="The address /metrics binds to; 0.0.0.0 to let other hosts scrape it.")
def worker(redis_url, queues, engine_config, name, lease, burst, metrics_port, metrics_addr):
    """Serve generation jobs from Redis with continuous batching.

    The first SIGINT/SIGTERM (or RQ's shutdown command) drains: no new jobs, the running ones finish,
    exit 0. A second one puts the running jobs back at the front of their queues."""
    from batcher.client import connect
    from workers.engine import build_engine
    from workers.rq_worker import BatchWorker

    for queue in queues:
        keys.check_queue(queue)
    connection = connect(redis_url)
    engine = build_engine(engine_config)
    hooks = {}
    if metrics_port is not None:
        from workers.metrics import EngineMetrics

        metrics = EngineMetrics(engine)
        server = metrics.start_http_server(metrics_port, metrics_addr)  # after the model loaded: probes rely on it
        click.echo(f"metrics on http://{metrics_addr}:{server.server_port}/metrics", err=True)
        hooks = metrics.worker_hooks()
    BatchWorker(keys.priority_queue_names(queues), engine, connection=connection, name=name,
                lease_s=lease, **hooks).work(burst=burst)


@main.command()
@redis_url_option
@queue_option
@click.argument("prompt", required=False)
@click.option("--file", "batch_file", type=click.File("r"),
              help="An OpenAI batch file (JSONL): one job per line, the custom_id kept in its metadata.")
@click.option("--max-tokens", type=click.IntRange(1), help="For PROMPT: the most tokens to generate.")
@click.option("--temperature", type=click.FloatRange(0), help="For PROMPT: 0 is greedy.")
@click.option("--priority", type=click.IntRange(0, keys.NUM_PRIORITIES - 1), default=0, show_default=True,
              help="For PROMPT: 0 is the most urgent.")
@click.option("--follow", is_flag=True, help="Wait: print PROMPT's text live, or each line's result as an OpenAI "
                                             "batch output line.")
def submit(redis_url, queue, prompt, batch_file, max_tokens, temperature, priority, follow):
    """Enqueue PROMPT, or every line of --file; print the job ids."""
    if (prompt is None) == (batch_file is None):
        raise click.UsageError("give either PROMPT or --file")
    client = _client(redis_url, queue)
    if prompt is not None:
        from batcher.schema import GenerationRequest

        sampling = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None}
        job_id = client.submit(GenerationRequest(prompt=prompt, sampling=sampling, priority=priority))
        click.echo(job_id)
        if follow:
            sys.exit(_print_stream(client, job_id))
        return
    sys.exit(_submit_file(client, batch_file, follow))


def _submit_file(client, batch_file, follow: bool) -> int:
    from batcher.client import JobFailed
    from batcher.openai_batch import BatchLineError, error_line, parse_batch_line, response_line

    rows: list[tuple[str | None, object]] = []  # (custom_id, request or error message), in file order
    for number, line in enumerate(batch_file, start=1):
        if not line.strip():
            continue
        try:
            custom_id, request = parse_batch_line(line)
        except BatchLineError as exc:
            click.echo(f"line {number}: {exc}", err=True)
            rows.append((exc.custom_id, str(exc)))
            continue
        if custom_id is not None:
            request = request.model_copy(update={"metadata": {**request.metadata, "custom_id": custom_id}})
        rows.append((custom_id, request))
    requests = [r for _, r in rows if not isinstance(r, str)]
    job_ids = iter(client.submit_many(requests))
    jobs = [(custom_id, r if isinstance(r, str) else None, None if isinstance(r, str) else next(job_ids))
            for custom_id, r in rows]
    bad = sum(1 for _, error, _ in jobs if error)
    if not follow:
        for custom_id, _, job_id in jobs:
            if job_id:
                click.echo(f"{job_id}\t{custom_id or ''}")
        return 1 if bad else 0
    for custom_id, error, job_id in jobs:
        if job_id is None:
            out = error_line(custom_id, error)
        else:
            try:
                out = response_line(custom_id, client.result(job_id))
            except JobFailed as exc:
                out = error_line(custom_id, exc.reason, code="generation_failed")
                bad += 1
        click.echo(json.dumps(out))
    return 1 if bad else 0


@main.command()
@redis_url_option
@click.argument("job_id")
def tail(redis_url, job_id):
    """Print a job's text as it is generated."""
    sys.exit(_print_stream(_client(redis_url), job_id))


def _print_stream(client, job_id: str) -> int:
    for event in client.stream(job_id):
        if event.type == "restart":
            click.echo("\n[the worker was lost; the job restarted]", err=True)
        elif event.type == "token":
            click.echo(event.text, nl=False)
        elif event.type == "done":
            click.echo()
            click.echo(f"[{event.finish_reason}]", err=True)
        elif event.type == "error":
            click.echo()
            click.echo(f"error: {event.error}", err=True)
            return 1
    return 0


@main.command()
@redis_url_option
@click.argument("job_id")
def status(redis_url, job_id):
    """Show a job's status, queue position, worker, times and failure reason."""
    info = _client(redis_url).status(job_id)
    for name, value in vars(info).items():
        if value is not None:
            click.echo(f"{name}: {value}")


@main.command()
@redis_url_option
@click.argument("job_id")
def cancel(redis_url, job_id):
    """Cancel a queued job, or stop a running one (its partial text is kept in its stream)."""
    cancelled = _client(redis_url).cancel(job_id)
    if not cancelled:
        raise click.ClickException(f"job {job_id} had already ended")
    click.echo(f"cancelled {job_id}")
