"""The `batcher` command. Each submodule registers one family of commands on `main`;
heavy imports (torch, transformers) happen inside the commands that need them.

An expected fault (Redis unreachable or refusing us, a model that cannot load, a bad input file, an unknown
job) ends a command with one line on stderr and a non-zero exit; `--debug` or BATCHER_DEBUG=1 shows the
traceback instead.
"""

import logging

import click
import redis.exceptions
from pydantic import ValidationError

from batcher.errors import BatcherError

DEBUG_ENV = "BATCHER_DEBUG"
FAULT_EXIT_CODE = 1


def describe_fault(exc: BaseException) -> str | None:
    """The one line a user sees for an expected fault; None for anything else (a bug: show the traceback)."""
    from batcher.openai_batch import readable

    if isinstance(exc, BatcherError):
        return str(exc)
    if isinstance(exc, redis.exceptions.AuthenticationError) or (
            isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))):
        return f"Redis refused the connection (a wrong or missing user or password in the URL?): {exc}"
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return f"cannot reach Redis: {exc}"
    if isinstance(exc, ValidationError):
        return f"invalid request: {readable(exc)}"
    if isinstance(exc, UnicodeDecodeError):
        return f"the input is not UTF-8 text ({exc.reason} at byte {exc.start})"
    return None


class FaultReportingGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Exception as exc:
            message = describe_fault(exc)
            if message is None or ctx.meta.get(DEBUG_ENV):
                raise
            click.echo(f"Error: {message}", err=True)
            ctx.exit(FAULT_EXIT_CODE)


@click.group(cls=FaultReportingGroup)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("--debug", is_flag=True, envvar=DEBUG_ENV, help="Show the traceback of an error, not one line.")
@click.pass_context
def main(ctx: click.Context, verbose: int, debug: bool) -> None:
    """LLM generation jobs on Redis, served with continuous batching."""
    ctx.meta[DEBUG_ENV] = debug
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose + debug, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


from batcher.cli import engine_commands  # noqa: E402,F401  (registers run, bench, demo)
from batcher.cli import job_commands  # noqa: E402,F401  (registers worker, submit, tail, status, cancel)
from batcher.cli import admin_commands  # noqa: E402,F401  (registers workers, drain, suspend, resume, queues, requeue)
from batcher.cli import batch_commands  # noqa: E402,F401  (registers the batch group)
from batcher.cli import serve_commands  # noqa: E402,F401  (registers serve)
