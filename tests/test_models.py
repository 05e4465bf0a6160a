"""Model resolution: clear errors for what cannot be served, refusal at load time."""

import pytest
from transformers import Gemma2Config

from rqbatcher.workers.model.loading import ModelLoadError, check_supported, load_model


def test_unknown_model_fails_clearly():
    with pytest.raises(ModelLoadError, match="not a local model folder"):
        load_model("no-such-org/no-such-model")


def test_a_file_is_not_a_model(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_model(str(path))


def test_softcapping_model_is_refused_before_loading_weights(tmp_path):
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    config.save_pretrained(tmp_path)  # no weights at all: the refusal must come first
    with pytest.raises(ModelLoadError, match="softcapping"):
        load_model(str(tmp_path))


def test_supported_families_pass_the_check(tiny_model_dir, family):
    loaded = load_model(str(tiny_model_dir(family)))
    check_supported(loaded.model.config)
    assert loaded.eos_token_ids == {2}
    assert loaded.model.config._attn_implementation == "batcher_paged"
