"""The `batcher` command. Each submodule registers one family of commands on `main`;
heavy imports (torch, transformers) happen inside the commands that need them.

An expected fault (Redis unreachable or refusing us, a model that cannot load, a bad input file, an unknown
job) ends a command with one line on stderr and a non-zero exit; `--debug` or BATCHER_DEBUG=1 shows the
traceback instead.
"""

# Each module registers its commands on `main`.
from rqbatcher.cli import (
    admin_commands,  # noqa: F401  (workers, drain, suspend, resume, queues, requeue)
    batch_commands,  # noqa: F401  (the batch group)
    engine_commands,  # noqa: F401  (worker, run, bench, demo: the one door into workers/)
    job_commands,  # noqa: F401  (submit, tail, status, cancel)
    serve_commands,  # noqa: F401  (serve)
    webhooks_commands,  # noqa: F401  (the webhooks group: add, list, remove, worker)
)
from rqbatcher.cli.group import main

__all__ = ["main"]
