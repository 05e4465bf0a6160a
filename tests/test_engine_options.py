"""The engine options shared by `run`, `bench` and `worker`: flags and their BATCHER_* variables."""

import click
from click.testing import CliRunner

from rqbatcher.cli.options import engine_options


@click.command()
@engine_options
def show(engine_config):
    click.echo(f"{engine_config.prefix_caching} {engine_config.block_size}")


def test_prefix_caching_is_on_unless_turned_off_by_flag_or_environment():
    runner = CliRunner()
    assert runner.invoke(show, []).output.split() == ["True", "16"]
    assert runner.invoke(show, ["--no-prefix-caching"]).output.split() == ["False", "16"]
    assert runner.invoke(show, [], env={"BATCHER_PREFIX_CACHING": "false"}).output.split() == ["False", "16"]
    assert runner.invoke(show, ["--prefix-caching"], env={"BATCHER_PREFIX_CACHING": "0"}).output.split()[0] == "True"
