"""`batcher demo` end to end on the embedded Redis, with a tiny model standing in for SmolLM2."""

import sys

from click.testing import CliRunner

from rqbatcher.cli import main
from rqbatcher.workers.demo import sample_requests
from tests.tiny_models import build_tiny_model


def test_demo_summarises_every_sample_and_compares_with_static(tmp_path):
    model = build_tiny_model("llama", tmp_path / "model", max_position_embeddings=8192)
    result = CliRunner().invoke(main, ["demo", "--model", str(model), "--compare"])
    assert result.exit_code == 0, result.output
    for custom_id, _ in sample_requests():
        assert f"== {custom_id} (" in result.output  # a summary, not a failure
    assert "continuous batching:" in result.output and "tok/s" in result.output
    assert "static batching:" in result.output and "measured in this run" in result.output


def test_without_fakeredis_the_demo_names_its_extra_or_a_real_redis(monkeypatch):
    monkeypatch.setitem(sys.modules, "fakeredis", None)  # as where the demo extra is not installed
    result = CliRunner().invoke(main, ["demo", "--model", "no-such-model"])
    assert result.exit_code != 0
    assert "pip install 'rqbatcher[demo]'" in result.output and "--redis-url" in result.output
