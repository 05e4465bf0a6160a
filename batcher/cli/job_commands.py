"""Commands for jobs on Redis: `submit`, `tail`, `status`, `cancel` (the worker is in engine_commands)."""

from __future__ import annotations

import json
import sys
from datetime import datetime

import click

import rqbatcher.cli.batch_commands as batch_commands
import rqbatcher.cli.options as options
from rqbatcher.cli.group import main
from rqbatcher.cli.options import json_option, queue_option, redis_url_option, replica_wait_options
from rqbatcher.jobs import keys

SCHEMA_NAME = "answer"  # the json_schema name of `submit --json-schema` (OpenAI's format requires one)


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
@click.option("--json-schema", "schema_file", type=click.File("rb"),
              help="For PROMPT: the answer is JSON that follows the JSON schema in this file.")
@click.option("--regex", help="For PROMPT: the answer matches this regular expression.")
@click.option("--frequency-penalty", type=click.FloatRange(-2, 2), help="For PROMPT: OpenAI's, over the answer.")
@click.option("--presence-penalty", type=click.FloatRange(-2, 2), help="For PROMPT: OpenAI's, over the answer.")
@click.option("--logit-bias", multiple=True, metavar="TOKEN_ID=BIAS", help="For PROMPT: add BIAS (-100 to 100) to "
                                                                           "the token's logit. Repeat for more.")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="For PROMPT: kept with the job and shown by "
                                                                     "`batcher status`. Repeat for more.")
@click.option("--user", help="For PROMPT: who the end user is (OpenAI's `user`), shown by `batcher status`.")
@replica_wait_options
def submit(redis_url, queue, prompt, batch_file, model, raw, max_tokens, temperature, priority, follow, schema_file,
           regex, frequency_penalty, presence_penalty, logit_bias, metadata, user):
    """Enqueue PROMPT and print its job id, or create a batch of --file and print the batch id."""
    if (prompt is None) == (batch_file is None):
        raise click.UsageError("give either PROMPT or --file")
    client = options.make_client(redis_url, queue)
    if prompt is not None:
        from pydantic import ValidationError

        from rqbatcher.errors import readable
        from rqbatcher.schema import GenerationRequest

        sampling = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature),
                                      ("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty))
                    if v is not None}
        sampling["logit_bias"] = _biases(logit_bias)
        constraint = _constraint(schema_file, regex)
        try:
            request = GenerationRequest(prompt=prompt, chat=not raw, model=model, sampling=sampling,
                                        priority=priority, user=user,
                                        metadata=options.key_values(metadata, "--metadata") or {},
                                        **constraint)
        except ValidationError as exc:
            raise click.UsageError(readable(exc)) from None
        job_id = client.submit(request)
        click.echo(job_id)
        if follow:
            sys.exit(_print_stream(client, job_id))
        return
    per_prompt = (model, schema_file, regex, frequency_penalty, presence_penalty, user, max_tokens, temperature)
    if raw or logit_bias or metadata or any(v is not None for v in per_prompt):
        raise click.UsageError("the options marked `For PROMPT` are not for --file: a batch file's lines carry "
                               "their own")
    created = batch_commands.create_batch(client, batch_file, priority=priority)
    click.echo(created.id)
    if follow:
        ended = batch_commands.wait_for(client, created.id)
        for errors in (False, True):
            for line in client.batch_output(created.id, errors=errors):
                click.echo(line, nl=False)
        sys.exit(0 if ended.status == "completed" and not ended.request_counts.failed else 1)


def _biases(pairs: tuple[str, ...]) -> dict[str, float]:
    """--logit-bias TOKEN_ID=BIAS options, each BIAS read as a number (the schema takes no text for one)."""
    biases = options.key_values(pairs, "--logit-bias") or {}
    try:
        return {token: float(bias) for token, bias in biases.items()}
    except ValueError:
        raise click.BadParameter("give TOKEN_ID=BIAS with BIAS a number", param_hint="--logit-bias") from None


def _constraint(schema_file, regex: str | None) -> dict:
    """The request fields of --json-schema FILE and --regex (at most one of them)."""
    if schema_file is not None and regex is not None:
        raise click.UsageError("give at most one of --json-schema and --regex")
    if regex is not None:
        return {"regex": regex}
    if schema_file is None:
        return {}
    import json

    try:
        schema = json.loads(schema_file.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise click.UsageError(f"--json-schema: {schema_file.name} is not JSON: {exc}") from None
    return {"response_format": {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": schema}}}


@main.command()
@redis_url_option
@click.argument("job_id")
def tail(redis_url, job_id):
    """Print a job's text as it is generated."""
    sys.exit(_print_stream(options.make_client(redis_url), job_id))


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
@json_option
def status(redis_url, job_id, as_json):
    """Show a job's status, queue position, worker, times and failure reason."""
    info = options.make_client(redis_url).status(job_id)
    if as_json:
        click.echo(json.dumps(vars(info), indent=1, default=datetime.isoformat))
        return
    for name, value in vars(info).items():
        if value is not None:
            click.echo(f"{name}: {value}")


@main.command()
@redis_url_option
@click.argument("job_id")
@replica_wait_options
def cancel(redis_url, job_id):
    """Cancel a queued job, or stop a running one (its partial text is kept in its stream)."""
    cancelled = options.make_client(redis_url).cancel(job_id)
    if not cancelled:
        raise click.ClickException(f"job {job_id} had already ended")
    click.echo(f"cancelled {job_id}")
