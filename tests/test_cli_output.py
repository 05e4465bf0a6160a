"""What the `batcher` commands print: --json on every command that prints data, every option's environment variable
in --help, and the settings table of docs/configuration.md matching the commands (on fakeredis: no worker, no torch).

Run `python -m tests.test_cli_output` to print the table after changing an option."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import rqbatcher.client
from rqbatcher.cli import main, options
from rqbatcher.client import Client
from rqbatcher.jobs import keys
from tests.jobs_support import fake_redis_fixture  # noqa: F401

SETTINGS_DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
TABLE_START, TABLE_END = "<!-- settings table: python -m tests.test_cli_output -->", "<!-- end of settings table -->"


@pytest.fixture(name="cli_redis")
def cli_redis_fixture(fake_redis, monkeypatch):
    """Every command's Redis is the fake one."""
    monkeypatch.setattr(options, "make_client", lambda url, queue=keys.DEFAULT_QUEUE: Client(fake_redis, queue=queue))
    monkeypatch.setattr(rqbatcher.client, "connect", lambda url=None: fake_redis)
    return fake_redis


def invoke_json(*args: str):
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_job_status_json_has_the_fields_of_the_text_form(cli_redis):
    job_id = Client(cli_redis).submit({"prompt": "a prompt", "user": "ann", "metadata": {"run": "7"}})
    shown = invoke_json("status", job_id)
    assert (shown["id"], shown["status"], shown["position"], shown["user"], shown["metadata"]) == (
        job_id, "queued", 0, "ann", {"run": "7"})
    assert shown["enqueued_at"].startswith(str(time.gmtime().tm_year)) and shown["worker"] is None


def test_queues_workers_and_batch_lists_print_json(cli_redis):
    client = Client(cli_redis, queue="jsonq")
    client.submit_many(["x", "y"])
    batch = client.create_batch([json.dumps({"custom_id": "c0", "method": "POST", "url": "/v1/completions",
                                             "body": {"model": "m", "prompt": "hi"}})])
    overview = invoke_json("queues", "--queue", "jsonq")
    assert overview["suspended"] is False
    assert sum(row["queued"] for row in overview["queues"]) == 3
    assert invoke_json("workers") == []
    assert [b["id"] for b in invoke_json("batch", "list")] == [batch.id]
    assert invoke_json("batch", "status", batch.id)["request_counts"]["total"] == 1
    assert invoke_json("webhooks", "list") == []


def commands(group: click.Group = main, path: tuple[str, ...] = ()):
    """Every command under `group`, by its words on the command line."""
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def test_every_option_read_from_the_environment_names_its_variable_in_help():
    for words, command in commands():
        shown = CliRunner().invoke(main, [*words.split(), "--help"], terminal_width=10_000).output
        for option in command.params:
            if isinstance(option, click.Option) and option.envvar:
                assert f"env var: {option.envvar}" in shown, (words, option.name)
    assert "env var: BATCHER_DEBUG" in CliRunner().invoke(main, ["--help"], terminal_width=10_000).output


def shown_default(option: click.Option) -> str:
    if option.default is None or option.default is click.core.UNSET:
        return "—"
    if option.is_flag and option.secondary_opts:
        return option.opts[0] if option.default else option.secondary_opts[0]
    if isinstance(option.default, (list, tuple)):
        return ", ".join(f"`{v}`" for v in option.default)
    return f"`{option.default}`"


def settings_table() -> str:
    """One row per option read from the environment: its variable, its default, the commands that take it, and the
    its help."""
    rows: dict[tuple[str, str, str], list[str]] = {}
    helps: dict[tuple[str, str, str], str] = {}
    for words, command in commands():
        for option in command.params:
            if isinstance(option, click.Option) and option.envvar:
                key = (option.envvar, "/".join(option.opts + option.secondary_opts), shown_default(option))
                rows.setdefault(key, []).append(words)
                helps.setdefault(key, (option.help or "").replace("|", "\\|"))
    lines = ["| Variable | Option | Default | Commands | What |", "|---|---|---|---|---|"]
    lines += [f"| `{envvar}` | `{opts}` | {default} | {', '.join(rows[envvar, opts, default])} | "
              f"{helps[envvar, opts, default]} |" for envvar, opts, default in sorted(rows)]
    return "\n".join(lines)


def test_the_settings_table_in_the_docs_matches_the_commands():
    text = SETTINGS_DOC.read_text()
    documented = text[text.index(TABLE_START) + len(TABLE_START):text.index(TABLE_END)].strip()
    assert documented == settings_table(), f"paste what `python -m tests.test_cli_output` prints into {SETTINGS_DOC}"


if __name__ == "__main__":
    print(settings_table())
