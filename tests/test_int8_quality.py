"""benchmarks/int8_quality.py: perplexity of int8 against float32 over the bundled held-out text or one's own
(`--text`), and greedy agreement, on a tiny model."""

from click.testing import CliRunner
from transformers import AutoTokenizer

from benchmarks import int8_quality
from tests.tiny_models import LONG_CONTEXT, build_tiny_model

TEXT = "The ferry left at seven, and the fog had not lifted when it reached the island. " * 8


def test_a_given_text_is_scored_in_both_formats(tmp_path):
    model = build_tiny_model("llama", tmp_path / "model", max_position_embeddings=LONG_CONTEXT)  # summarise's prompts
    text = tmp_path / "notes.txt"
    text.write_text(TEXT, encoding="utf-8")
    report = int8_quality.run(str(model), threads=1, window=32, num_prompts=2, max_tokens=2, text=text)
    tokens = len(AutoTokenizer.from_pretrained(model)(TEXT)["input_ids"])
    assert report["text"] == "notes.txt" and report["text_tokens"] == tokens > 32  # more than one window
    assert all(1 < score < float("inf") for score in report["perplexity"].values())
    assert report["perplexity"]["int8"] != report["perplexity"]["none"]  # the quantized model scored, not the float one
    assert 0 < report["next_token_agreement"] <= 1
    assert f"| perplexity ({tokens} tokens of notes.txt, windows of 32) |" in int8_quality.table(report)


def test_a_missing_empty_or_binary_text_is_named(tmp_path):
    runner = CliRunner()
    result = runner.invoke(int8_quality.main, ["--text", str(tmp_path / "absent.txt")])
    assert result.exit_code == 2 and "absent.txt" in result.output
    model = str(build_tiny_model("llama", tmp_path / "m"))
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    for name, named in [("empty.txt", "empty.txt has 0 token(s)"), ("image.png", "image.png is not UTF-8 text")]:
        result = runner.invoke(int8_quality.main, ["--model", model, "--text", str(tmp_path / name)])
        assert result.exit_code == 2 and named in result.output, result.output
