"""`batcher demo` end to end on the embedded Redis, with a tiny model standing in for SmolLM2."""

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
