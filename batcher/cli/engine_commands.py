"""Commands that drive the engine directly, without Redis: `run` (offline batch) and `bench`."""

from __future__ import annotations

import click

from batcher.cli import main
from batcher.cli.options import engine_options


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

    from workers.engine import build_engine
    from workers.offline import run_batch

    lines = input_path.readlines()
    engine = build_engine(engine_config)
    total = sum(1 for line in lines if line.strip())
    with click.progressbar(length=total, label="generating", file=sys.stderr) as bar:
        results = run_batch(engine, lines, on_done=lambda: bar.update(1))
    for result in results:
        output_path.write(json.dumps(result) + "\n")
    failed = sum(1 for r in results if r["error"])
    if print_texts:
        for r in results:
            body = r["response"]["body"] if r["response"] else None
            click.echo(f"\n== {r['custom_id']} ==")
            click.echo(body["choices"][0]["text"].strip() if body else f"error: {r['error']['message']}")
    click.echo(f"{len(results) - failed} succeeded, {failed} failed -> {output_path.name}", err=True)


@main.command()
@engine_options
@click.option("--workload", required=True, help="A workload file, or a bundled one: skew, skew-small, summarise, "
              "mixed, interference.")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True,
              help="torch CPU threads (set explicitly: on a shared CPU, threads fight).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the full report as JSON.")
def bench(engine_config, workload, threads, json_path):
    """Run a benchmark workload through the engine and report throughput and latency."""
    import json

    import torch

    from batcher.workload import load_workload, workload_path
    from workers.bench import run_bench
    from workers.engine import build_engine

    torch.set_num_threads(threads)
    items = load_workload(workload)
    engine = build_engine(engine_config)
    report, _ = run_bench(engine, items, workload_path(workload).stem, threads)
    click.echo(report.summary())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
