"""The `batcher` command. Each submodule registers one family of commands on `main`;
heavy imports (torch, transformers) happen inside the commands that need them."""

import logging

import click


@click.group()
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """LLM generation jobs on Redis, served with continuous batching."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


from batcher.cli import engine_commands  # noqa: E402,F401  (registers run, bench)
from batcher.cli import job_commands  # noqa: E402,F401  (registers worker, submit, tail, status, cancel)
from batcher.cli import admin_commands  # noqa: E402,F401  (registers workers, drain, suspend, resume, queues, requeue)
from batcher.cli import batch_commands  # noqa: E402,F401  (registers the batch group)
