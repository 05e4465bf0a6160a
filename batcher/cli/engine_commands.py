"""Commands that run a model: `worker`, `run` (an offline batch file), `bench` and `demo`.

This is the one CLI module that reaches into `workers/`, and only through `workers.entrypoints`, imported inside
each command: the light install (no torch) runs every other command.
"""

from __future__ import annotations

import click

from rqbatcher.cli.group import main
from rqbatcher.cli.options import engine_options, prefix_caching_option, redis_url_option, replica_wait_options
from rqbatcher.client import REDIS_URL_ENV
from rqbatcher.config import DEFAULT_METRICS_ADDR, EngineConfig
from rqbatcher.jobs import keys
from rqbatcher.jobs.contract import DEFAULT_LEASE_S


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
@replica_wait_options
def worker(redis_url, queues, engine_config, name, served_model_name, lease, burst, metrics_port, metrics_addr):
    """Serve generation jobs from Redis with continuous batching.

    The first SIGINT/SIGTERM (or RQ's shutdown command) drains: no new jobs, the running ones finish,
    exit 0. A second one puts the running jobs back at the front of their queues."""
    from rqbatcher.workers import entrypoints
    entrypoints.serve_worker(redis_url, list(queues), engine_config, name=name, served_model_name=served_model_name,
                             lease_s=lease, burst=burst, metrics_port=metrics_port, metrics_addr=metrics_addr,
                             announce=lambda line: click.echo(line, err=True))


@main.command()
@engine_options
@click.option("--input", "input_path", type=click.File("r"), required=True,
              help="Requests in the OpenAI batch file format (JSONL).")
@click.option("--output", "output_path", type=click.File("w"), required=True, help="Where to write results (JSONL).")
@click.option("--print", "print_texts", is_flag=True, help="Also print each result's text to stdout.")
def run(engine_config, input_path, output_path, print_texts):
    """Run a batch file through the engine offline (no Redis) and write results in input order."""
    import json
    import sys

    from rqbatcher.workers import entrypoints
    lines = input_path.readlines()
    engine = entrypoints.load_engine(engine_config)
    total = sum(1 for line in lines if line.strip())
    with click.progressbar(length=total, label="generating", file=sys.stderr) as bar:
        results = entrypoints.run_file(engine, lines, on_done=lambda: bar.update(1))
    for result in results:
        output_path.write(json.dumps(result) + "\n")
    failed = sum(1 for r in results if r["error"])
    if print_texts:
        for r in results:
            body = r["response"]["body"] if r["response"] else None
            click.echo(f"\n== {r['custom_id']} ==")
            click.echo(body["choices"][0]["text"].strip() if body else f"error: {r['error']['message']}")
    click.echo(f"{len(results) - failed} succeeded, {failed} failed -> {output_path.name}", err=True)


def _systems(ctx, param, value):
    from rqbatcher.workers import entrypoints
    try:
        return [entrypoints.parse_system(s.strip()) for s in value.split(",") if s.strip()] if value else []
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@main.command()
@engine_options
@click.option("--workload", required=True, help="A workload file, or a bundled one: skew, skew-small, summarise, "
              "mixed, interference, doc-qa, system-prompt.")
@click.option("--systems", callback=_systems, help="Comma-separated systems to run, in order: batcher:continuous, "
              "batcher:static; each runs with its prefix cache unless named with :no-prefix-caching, and with the "
              "suffix @redis it is served through Redis and a worker (batcher:continuous:no-prefix-caching@redis). "
              "Default: batcher with --policy. The peers (transformers, llama.cpp) run from a checkout: "
              "python -m benchmarks.compare.")
@click.option("--through", type=click.Choice(["engine", "redis"]), default="engine", show_default=True,
              help="redis: run the systems as jobs through Redis and a worker (arrival times honoured).")
@redis_url_option
@click.option("--baseline", help="The system the ratios are against (default: the first one).")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True,
              help="torch CPU threads (set explicitly: on a shared CPU, threads fight).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the full report as JSON.")
def bench(engine_config, workload, systems, through, redis_url, baseline, threads, json_path):
    """Run a workload through the engine's systems on equal terms; print throughput, time to first token and
    inter-token latency, with ratios to a baseline.

    Slots (--max-num-seqs), page size (--block-size), KV blocks, the token budget (--max-num-batched-tokens) and
    --no-prefix-caching apply to every system. Greedy tokens are compared with the baseline's, and every difference
    is shown.
    """
    import json

    from rqbatcher.workers import entrypoints
    def as_run(system):
        """The system as this invocation runs it, after --through and --no-prefix-caching."""
        system = system.via_redis() if through == "redis" else system
        return system if engine_config.prefix_caching else system.without_prefix_caching()

    default = f"batcher:{engine_config.policy}"
    systems = list(dict.fromkeys(as_run(s) for s in systems or [entrypoints.parse_system(default)]))
    try:
        baseline = as_run(entrypoints.parse_system(baseline)) if baseline else systems[0]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--baseline") from None
    if baseline not in systems:
        raise click.BadParameter(f"{baseline} is not among --systems", param_hint="--baseline")
    report = entrypoints.bench(workload, systems, baseline, engine_config, threads, redis_url)
    click.echo(report.table())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    if not report.all_agree:
        click.echo("warning: greedy tokens differ between systems (listed above)", err=True)


DEMO_MAX_NUM_SEQS = 4  # fewer slots than jobs, so the jobs contend for slots as on a busy worker


@main.command()
@click.option("--redis-url", envvar=REDIS_URL_ENV, help="A real Redis; default: an embedded one.")
@click.option("--model", default="smollm2", envvar="BATCHER_MODEL", show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(1), default=DEMO_MAX_NUM_SEQS, show_default=True)
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Then run the same jobs under static batching and print the ratio.")
@prefix_caching_option
def demo(redis_url, model, max_num_seqs, compare, prefix_caching):
    """Summarise the bundled documents through Redis and a worker, live, on the bundled model."""
    from rqbatcher.workers import entrypoints
    entrypoints.demo(redis_url, EngineConfig(model=model, max_num_seqs=max_num_seqs, prefix_caching=prefix_caching),
                     compare)
