"""The `batcher` click group, and how it reports an expected fault: one line on stderr and exit 1."""

from __future__ import annotations

import logging

import click
import redis.exceptions
from pydantic import ValidationError

from rqbatcher.errors import BatcherError

DEBUG_ENV = "BATCHER_DEBUG"
FAULT_EXIT_CODE = 1


def describe_fault(exc: BaseException) -> str | None:
    """The one line a user sees for an expected fault; None for anything else (a bug: show the traceback)."""
    from rqbatcher.errors import readable

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


def show_envvars(command: click.Command) -> None:
    """Name the environment variable of every option read from one in `--help` (click hides it by default), so that
    a deployment's settings can be read off the help of the command it runs."""
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar:
            param.show_envvar = True


class FaultReportingGroup(click.Group):
    group_class = type  # sub-groups (batch, webhooks) report faults and show environment variables the same way

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        show_envvars(cmd)
        super().add_command(cmd, name)

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


show_envvars(main)
