"""GGUF files as models (`--model file.gguf`): converted once per version of the file, into the weights, tokenizer
and chat template of the model the file was written from, and served like any other model, int8 weights included."""

import json

import gguf
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from rqbatcher.cli import main
from rqbatcher.workers.model.int8_linear import native_int8, quantize_linears
from rqbatcher.workers.model.loading import GGUF_CACHE_NAME, ModelLoadError, load_model
from tests.engine_helpers import engine_for, generate_greedy, greedy, random_prompts, run_all
from tests.tiny_models import build_tiny_gguf

TEXT = "The quick brown fox jumps, café 東京 🙂"
Q8_0 = gguf.GGMLQuantizationType.Q8_0
MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """This test's own cache: its conversions land here."""
    monkeypatch.setenv("BATCHER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / GGUF_CACHE_NAME


def original(gguf_path):
    """The model `build_tiny_gguf` wrote the file from (it keeps it beside the file)."""
    return AutoModelForCausalLM.from_pretrained(gguf_path.with_suffix(".hf"), dtype=torch.float32).eval()


def q8_0_values(model) -> dict[str, torch.Tensor]:
    """The model's weights as a Q8_0 file holds them: each matrix in blocks of 32 with a scale each, dequantized."""
    return {name: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), Q8_0), Q8_0))
            if tensor.dim() == 2 else tensor for name, tensor in model.state_dict().items()}


def int8_reference(gguf_path) -> torch.nn.Module:
    """The Q8_0 file's values in the model it was written from, then quantized per output channel as a worker here
    quantizes them."""
    reference = original(gguf_path)
    reference.load_state_dict(q8_0_values(reference))
    quantize_linears(reference, on_native=native_int8(torch.device("cpu")))
    return reference


def test_an_f32_gguf_loads_as_the_model_it_was_written_from(tmp_path, cache):
    path = build_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(str(path))
    expected = original(path).state_dict()
    assert loaded.model.state_dict().keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in loaded.model.state_dict().items())
    tokenizer = AutoTokenizer.from_pretrained(path.with_suffix(".hf"))
    assert loaded.tokenizer(TEXT).input_ids == tokenizer(TEXT).input_ids
    assert loaded.tokenizer.chat_template == tokenizer.chat_template
    assert loaded.eos_token_ids == {2}
    assert loaded.name == str(path)
    assert [folder.name.split("-")[0] for folder in cache.iterdir()] == ["tiny"]


def test_a_q8_0_gguf_loads_its_blocks_dequantized(tmp_path):
    path = build_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    loaded, written_from = load_model(str(path)).model.state_dict(), original(path)
    expected = q8_0_values(written_from)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in loaded.items())
    assert not all(torch.equal(tensor, written_from.state_dict()[name]) for name, tensor in loaded.items())


def test_an_engine_serves_a_q8_0_gguf_on_int8_weights(tmp_path):
    """Each greedy token that of the file's dequantized model, quantized again per output channel, on its own."""
    path = build_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    engine = engine_for(path, quantization="int8", max_num_seqs=4)
    prompts = random_prompts(5, seed=3, min_len=3, max_len=30)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, MAX_TOKENS))
    finals = run_all(engine)
    reference = int8_reference(path)
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == generate_greedy(reference, prompt, MAX_TOKENS), i


def test_a_gguf_is_converted_once_per_version_of_the_file(tmp_path, cache):
    path = build_tiny_gguf(tmp_path / "tiny.gguf")
    first = load_model(str(path)).model.state_dict()
    (folder,) = cache.iterdir()
    converted_at = (folder / "config.json").stat().st_mtime_ns
    load_model(str(path))
    assert list(cache.iterdir()) == [folder]
    assert (folder / "config.json").stat().st_mtime_ns == converted_at

    build_tiny_gguf(path, "Q8_0")  # the same path, a new file
    second = load_model(str(path)).model.state_dict()
    assert len(list(cache.iterdir())) == 2
    assert not all(torch.equal(tensor, first[name]) for name, tensor in second.items())


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF" + bytes(60), "cut in its header",
                                     "cut in its tensors"])
def test_a_file_that_is_no_readable_gguf_fails_clearly_and_leaves_nothing_cached(tmp_path, cache, content):
    if isinstance(content, str):  # a real file, cut short
        whole = build_tiny_gguf(tmp_path / "whole.gguf", "Q8_0").read_bytes()
        content = whole[:2000] if content.endswith("header") else whole[: len(whole) // 2]
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="cannot load GGUF file .*broken.gguf"):
        load_model(str(path))
    assert not cache.exists() or not list(cache.iterdir())


def test_batcher_run_serves_a_gguf_file_with_its_chat_template(tmp_path):
    """`batcher run --model file.gguf --quantization int8`: a completion's tokens as above, and a chat line's prompt
    written by the chat template the file carries."""
    path = build_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    messages = [{"role": "user", "content": "hello there"}]
    lines = [{"custom_id": "completion", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": [9, 10, 11], "max_tokens": MAX_TOKENS, "ignore_eos": True}},
             {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": messages, "max_tokens": 2}}]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["run", "--model", str(path), "--quantization", "int8", "--dtype", "float32",
                                       "--input", str(source), "--output", str(results)])
    assert result.exit_code == 0, result.output
    completion, chat = (json.loads(line)["response"]["body"] for line in results.read_text().splitlines())
    assert completion["choices"][0]["token_ids"] == generate_greedy(int8_reference(path), [9, 10, 11], MAX_TOKENS)
    assert completion["model"] == chat["model"] == str(path)
    prompt = AutoTokenizer.from_pretrained(path.with_suffix(".hf")).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["usage"]["prompt_tokens"] == len(prompt)


def test_a_gguf_of_a_model_our_attention_cannot_serve_is_refused_from_its_metadata(tmp_path, cache):
    """A Gemma2 file (logit softcapping) with no tensors at all: the refusal must come before any is read."""
    path = tmp_path / "gemma2.gguf"
    writer = gguf.GGUFWriter(path, "gemma2")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(16)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="cannot load GGUF file .*softcapping"):
        load_model(str(path))
    assert not cache.exists() or not list(cache.iterdir())
