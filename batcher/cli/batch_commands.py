"""`batcher batch create | status | list | cancel | output`: OpenAI batch files as one tracked batch."""

from __future__ import annotations

import contextlib
import json
import sys
import time

import click

import rqbatcher.cli.options as options
from rqbatcher.batches.batch_object import DEFAULT_COMPLETION_WINDOW
from rqbatcher.cli.group import main
from rqbatcher.cli.options import json_option, queue_option, redis_url_option, replica_wait_options
from rqbatcher.jobs import keys
from rqbatcher.openai.batch_endpoints import ENDPOINTS

WAIT_POLL_S = 0.5
DEFAULT_LIST_LIMIT = 20


@contextlib.contextmanager
def batch_errors():
    """Turn an unknown batch id, bad batch settings or a full queue into a one-line CLI error (a bad line
    of the file is not an error here: it becomes a failed request with its reason in the error file)."""
    from rqbatcher.batches.batch_object import BatchInputError, BatchNotFound
    from rqbatcher.client import QueueFull

    try:
        yield
    except (BatchNotFound, BatchInputError, QueueFull) as exc:
        raise click.ClickException(str(exc)) from None


@main.group()
def batch():
    """Batches: an OpenAI batch file run as one tracked set of jobs."""


def create_batch(client, batch_file, *, endpoint=None, window=DEFAULT_COMPLETION_WINDOW, metadata=None,
                 priority: int = 0):
    """Create a batch from an open file; say where its jobs wait when no live worker serves their model."""
    with batch_errors():
        created = client.create_batch(batch_file, endpoint=endpoint, completion_window=window, metadata=metadata,
                                      priority=priority)
    if created.status == "failed":
        reason = "; ".join(e.message for e in created.errors.data) if created.errors else "it failed"
        raise click.ClickException(f"batch {created.id} failed: {reason}")
    served = set(client.models())
    if created.model is not None and created.model not in served:
        click.echo(f"note: no live worker serves model {created.model!r}; its jobs wait until one does", err=True)
    counts = created.request_counts
    click.echo(f"batch {created.id}: {counts.total} requests ({counts.failed} bad lines), {created.status}", err=True)
    return created


def wait_for(client, batch_id: str):
    """Follow a batch to its end with a progress bar; return the ended batch."""
    with batch_errors():
        current = client.batch(batch_id)
    with click.progressbar(length=max(1, current.request_counts.total), label=batch_id, file=sys.stderr,
                           show_pos=True) as bar:
        while True:
            counts = current.request_counts
            bar.update(max(0, counts.completed + counts.failed - bar.pos))
            if current.ended:
                break
            time.sleep(WAIT_POLL_S)
            current = client.batch(batch_id)
    counts = current.request_counts
    click.echo(f"{current.status}: {counts.completed} completed, {counts.failed} failed of {counts.total}", err=True)
    return current


@batch.command("create")
@redis_url_option
@queue_option
@click.argument("batch_file", metavar="FILE", type=click.File("rb"))
@click.option("--endpoint", type=click.Choice(ENDPOINTS), help="Default: the url of the file's first line.")
@click.option("--window", default=DEFAULT_COMPLETION_WINDOW, show_default=True,
              help="Completion window (s, m, h or d): unfinished requests are then cancelled, the batch expired.")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Repeat for more than one.")
@click.option("--priority", type=click.IntRange(0, keys.NUM_PRIORITIES - 1), default=0, show_default=True)
@click.option("--wait", is_flag=True, help="Show progress until the batch ends; exit 1 unless it completed.")
@replica_wait_options
def create(redis_url, queue, batch_file, endpoint, window, metadata, priority, wait):
    """Create a batch from an OpenAI batch FILE (JSONL) and print its id."""
    client = options.make_client(redis_url, queue)
    created = create_batch(client, batch_file, endpoint=endpoint, window=window,
                           metadata=options.key_values(metadata, "--metadata"), priority=priority)
    click.echo(created.id)
    if wait and wait_for(client, created.id).status != "completed":
        sys.exit(1)


@batch.command("status")
@redis_url_option
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="The OpenAI Batch object.")
def status(redis_url, batch_id, as_json):
    """Show a batch's status, request counts and times."""
    with batch_errors():
        found = options.make_client(redis_url).batch(batch_id)
    if as_json:
        click.echo(found.model_dump_json(indent=1))
        return
    counts = found.request_counts
    click.echo(f"id: {found.id}\nstatus: {found.status}\nendpoint: {found.endpoint}\n"
               f"requests: {counts.completed} completed, {counts.failed} failed of {counts.total}")
    for name, value in found.model_dump(exclude={"id", "object", "status", "endpoint", "request_counts"}).items():
        if value is not None:
            click.echo(f"{name}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")


@batch.command("list")
@redis_url_option
@click.option("--limit", type=click.IntRange(1), default=DEFAULT_LIST_LIMIT, show_default=True,
              help="The most batches to show.")
@click.option("--after", help="Page on from this batch id.")
@json_option
def list_batches(redis_url, limit, after, as_json):
    """Batches, newest first."""
    with batch_errors():
        found = options.make_client(redis_url).batches(after=after, limit=limit)
    if as_json:
        click.echo(json.dumps([b.model_dump(mode="json") for b in found], indent=1))
        return
    if not found:
        click.echo("no batches")
        return
    for b in found:
        c = b.request_counts
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.created_at))
        click.echo(f"{b.id}  {b.status:<11}  {c.completed + c.failed}/{c.total} done ({c.failed} failed)  {created}")


@batch.command("cancel")
@redis_url_option
@click.argument("batch_id")
def cancel(redis_url, batch_id):
    """Cancel a batch: its queued jobs are dropped, its running ones stopped; finished results stay."""
    with batch_errors():
        cancelled = options.make_client(redis_url).cancel_batch(batch_id)
    click.echo(f"{batch_id}: {cancelled.status}")


@batch.command("output")
@redis_url_option
@click.argument("batch_id")
@click.option("--errors", is_flag=True, help="The error file instead of the output file.")
def output(redis_url, batch_id, errors):
    """Print a batch's output file (or error file) as far as it has run, in input order."""
    with batch_errors():
        for line in options.make_client(redis_url).batch_output(batch_id, errors=errors):
            click.echo(line, nl=False)
