"""Commands for jobs on Redis: `worker`, `submit`, `tail`, `status`, `cancel`."""

from __future__ import annotations

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
@click.option("--served-model-name", envvar="BATCHER_SERVED_MODEL_NAME",
              help="The model name jobs give to run here (default: --model as given). The worker takes jobs "
                   "that name this model, and jobs that name none.")
@click.option("--lease", type=click.IntRange(1), default=DEFAULT_LEASE_S, envvar="BATCHER_LEASE_S", show_default=True,
              help="Seconds a job's lease lasts without a heartbeat: how soon a dead worker's jobs "
                               "are retried.")
@click.option("--burst", is_flag=True, help="Exit once the queues are empty and no job is in flight.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), envvar="BATCHER_METRICS_PORT",
              help="Serve Prometheus metrics on this port (off when not given).")
@click.option("--metrics-addr", default=DEFAULT_METRICS_ADDR, envvar="BATCHER_METRICS_ADDR", show_default=True,
              help="The address /metrics binds to; 0.0.0.0 to let other hosts scrape it.")
def worker(redis_url, queues, engine_config, name, served_model_name, lease, burst, metrics_port, metrics_addr):
    """Serve generation jobs from Redis with continuous batching.

    The first SIGINT/SIGTERM (or RQ's shutdown command) drains: no new jobs, the running ones finish,
    exit 0. A second one puts the running jobs back at the front of their queues."""
    from batcher.client import connect
    from workers.engine import build_engine
    from workers.rq_worker import BatchWorker

    for queue in queues:
        keys.model_queue(queue, served_model_name or engine_config.model)  # checks the name, before the model loads
    connection = connect(redis_url)
    engine = build_engine(engine_config)
    hooks = {}
    if metrics_port is not None:
        from workers.metrics import EngineMetrics

        from workers.class_metrics import ClassMetrics, combined_hooks

        metrics = EngineMetrics(engine)
        server = metrics.start_http_server(metrics_port, metrics_addr)  # after the model loaded: probes rely on it
        click.echo(f"metrics on http://{metrics_addr}:{server.server_port}/metrics", err=True)
        hooks = combined_hooks(metrics.worker_hooks(), ClassMetrics(engine).worker_hooks())
    model_name = served_model_name or engine_config.model
    BatchWorker(keys.priority_queue_names(queues, model=model_name), engine, connection=connection, name=name,
                model_name=model_name, lease_s=lease, **hooks).work(burst=burst)


@main.command()
@redis_url_option
@queue_option
@click.argument("prompt", required=False)
@click.option("--file", "batch_file", type=click.File("rb"),
              help="An OpenAI batch file (JSONL): create a batch of it (as `batcher batch create`).")
@click.option("--model", help="Run on a worker serving this model (default: any worker of the queue).")
@click.option("--raw", is_flag=True, help="For PROMPT: a plain completion prompt. By default PROMPT is sent as a "
                                          "user chat message when the serving model has a chat template.")
@click.option("--max-tokens", type=click.IntRange(1), help="For PROMPT: the most tokens to generate.")
@click.option("--temperature", type=click.FloatRange(0), help="For PROMPT: 0 is greedy.")
@click.option("--priority", type=click.IntRange(0, keys.NUM_PRIORITIES - 1), default=0, show_default=True,
              help="0 is the most urgent.")
@click.option("--follow", is_flag=True, help="Wait: print PROMPT's text live, or the batch's progress and then its "
                                             "output and error lines.")
def submit(redis_url, queue, prompt, batch_file, model, raw, max_tokens, temperature, priority, follow):
    """Enqueue PROMPT and print its job id, or create a batch of --file and print the batch id."""
    if (prompt is None) == (batch_file is None):
        raise click.UsageError("give either PROMPT or --file")
    client = _client(redis_url, queue)
    if prompt is not None:
        from batcher.schema import GenerationRequest

        sampling = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None}
        job_id = client.submit(GenerationRequest(prompt=prompt, chat=not raw, model=model, sampling=sampling,
                                                 priority=priority))
        click.echo(job_id)
        if follow:
            sys.exit(_print_stream(client, job_id))
        return
    if model is not None or raw:
        raise click.UsageError("--model and --raw are for PROMPT; a batch file names each line's model")
    from batcher.cli.batch_commands import create_batch, wait_for

    created = create_batch(client, batch_file, priority=priority)
    click.echo(created.id)
    if follow:
        ended = wait_for(client, created.id)
        for errors in (False, True):
            for line in client.batch_output(created.id, errors=errors):
                click.echo(line, nl=False)
        sys.exit(0 if ended.status == "completed" and not ended.request_counts.failed else 1)


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
