"""The engine's speed paths against the plain ones: `--dtype auto`, packed bf16 linears, the compiled forward."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rqbatcher.workers.model import precision
from rqbatcher.workers.model.compiled_forward import bucket_sizes
from rqbatcher.workers.model.packed_linear import PackedLinear, can_pack, pack_linears
from tests.engine_helpers import engine_for, greedy, random_prompts, reference_tokens, run_all
from tests.tiny_models import build_tiny_model

needs_packing = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                   reason="this CPU's oneDNN has no native bf16")


@pytest.mark.parametrize("speedup,chosen", [(3.0, "bfloat16"), (1.05, "float32"), (0.4, "float32")])
def test_auto_keeps_bf16_only_where_it_races_clearly_faster_on_cpu(monkeypatch, speedup, chosen):
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: speedup)
    assert precision.resolve_dtype("auto", torch.device("cpu")) == chosen
    assert precision.resolve_dtype("float16", torch.device("cpu")) == "float16"  # an explicit choice stands


def test_the_race_measures_both_dtypes():
    assert precision.cpu_bf16_speedup() > 0


def test_an_auto_engine_runs_in_a_concrete_dtype(tiny_model_dir):
    engine = engine_for(tiny_model_dir("llama"), dtype="auto")
    assert engine.dtype in ("float32", "bfloat16") and engine.runner.dtype == precision.DTYPES[engine.dtype]
    engine.add("r", greedy([5, 6, 7], 3))
    assert len(run_all(engine)["r"].token_ids) == 3


@needs_packing
def test_packed_linears_give_the_same_logits_bit_for_bit(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.bfloat16).eval()
    ids = torch.tensor([random_prompts(1, seed=4, min_len=20)[0]])
    with torch.inference_mode():
        plain = model(ids).logits
        assert pack_linears(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
        assert torch.equal(model(ids).logits, plain)


@needs_packing
def test_packed_linear_compiles_to_the_same_result():
    layer = torch.nn.Linear(32, 48).to(torch.bfloat16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    pack_linears(torch.nn.Sequential(layer))
    assert isinstance(layer, PackedLinear)
    with torch.inference_mode():
        assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))


def test_bucket_sizes_double_up_to_the_largest_step():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert bucket_sizes(28) == [1, 2, 4, 8, 16, 28]


def test_compiled_engine_matches_generate(tmp_path):
    """Every step fits a bucket (budget 4: buckets 1, 2, 4), so decodes, prefill chunks, mixed steps and
    padding (3 tokens run as 4) all go through the compiled forward, in float32. One layer keeps it cheap:
    with inductor's cache cold, this test took 19 s with one layer and 74 s with two, on a loaded 2-core CPU."""
    model_dir = build_tiny_model("llama", tmp_path / "llama-1-layer", num_hidden_layers=1)
    engine = engine_for(model_dir, dtype="float32", compile=True, max_num_seqs=4, max_num_batched_tokens=4)
    assert engine.runner.compiled.buckets == [1, 2, 4]
    compiled_steps = []
    forward = engine.runner.compiled._forward
    engine.runner.compiled._forward = lambda **inputs: compiled_steps.append(inputs) or forward(**inputs)
    prompts = random_prompts(6, seed=5, max_len=20)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, 10))
    finals = run_all(engine)
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == reference_tokens(model_dir, prompt, 10), f"request r{i} diverged"
    assert len(compiled_steps) == engine.step_index
    assert {inputs["input_ids"].shape[1] for inputs in compiled_steps} == {1, 2, 4}
