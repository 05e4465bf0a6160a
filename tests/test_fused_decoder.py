"""The fused decoder forward (`workers.model.fused_decoder`) and the layer ops it runs (`kernels.native`), in bf16 and
fp32.

The layer ops must give transformers' own bits, and the fused forward the logits of transformers' forward on
the same engine, step for step. Each dtype's tests run only on a CPU where its build runs (bf16: AVX-512 BF16;
fp32: AVX2 and FMA); elsewhere they skip (and the fused forward is not used in that dtype),
and a CPU that qualifies but fails to build the kernels fails here.
"""

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from rqbatcher.kernels import native
from rqbatcher.workers.model.fused_decoder import FusedDecoder, why_not
from rqbatcher.workers.model.packed_linear import (
    FewRowsLinear,
    JointLinear,
    PackedLinear,
    pack_linears,
    route_fp32_linears,
)
from tests.engine_helpers import engine_for, greedy, random_prompts, record_logits, run_all
from tests.tiny_models import build_tiny_model

FLAGS = native.cpu_flags()


def _build_runs_here(build: native.Build) -> bool:
    """The build's CPU rule, read from the flags alone: a CPU that qualifies must build, not skip."""
    return native.why_not_here(build, FLAGS) is None


on_bf16 = pytest.mark.skipif(not _build_runs_here(native.BF16), reason="this CPU has no AVX-512 BF16")
BF16 = pytest.param(torch.bfloat16, id="bf16", marks=on_bf16)
FP32 = pytest.param(torch.float32, id="fp32", marks=pytest.mark.skipif(
    not _build_runs_here(native.FP32), reason="the fp32 build needs AVX2 and FMA"))
BOTH = [BF16, FP32]


def tensor(dtype, *shape, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def fast_linears(model: torch.nn.Module, dtype: torch.dtype, batch_invariant: bool = False) -> None:
    """What the runner does to a model's linears in `dtype` on a CPU whose kernels load."""
    if dtype == torch.bfloat16:
        pack_linears(model, few_rows_native=True, batch_invariant=batch_invariant)
    else:
        route_fp32_linears(model)


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("hidden", [576, 64, 50, 72, 896, 4096])
@pytest.mark.parametrize("norm_class", [LlamaRMSNorm, Qwen2RMSNorm])
def test_rms_norm_gives_the_modules_bits(hidden, norm_class, dtype):
    """Rows of very different scales (as a residual stream has), and widths with a tail and with the sum's
    deeper cascade (4096)."""
    norm = norm_class(hidden, eps=1e-5).to(dtype)
    norm.weight.data = tensor(dtype, hidden, seed=1)
    x = tensor(dtype, 200, hidden, seed=2) * tensor(dtype, 200, 1, scale=20, seed=3)
    assert torch.equal(native.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    assert torch.equal(native.rms_norm(x[:1], norm.weight, norm.variance_epsilon), norm(x[:1]))


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("hidden", [576, 50, 100])  # whole passes of 64 values, a part of one, both
def test_add_rms_norm_adds_in_place_then_normalises(hidden, dtype):
    norm = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    norm.weight.data = tensor(dtype, hidden, seed=1)
    residual, delta = tensor(dtype, 33, hidden, scale=8, seed=2), tensor(dtype, 33, hidden, seed=3)
    summed = residual + delta
    out = native.add_rms_norm(residual, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(residual, summed)
    assert torch.equal(out, norm(summed))


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("head_dim", [64, 128, 16, 40])
def test_rotary_gives_apply_rotary_pos_emb_bits_in_place(head_dim, dtype):
    """head_dim 16 and 40: halves shorter than a vector, and one with a tail."""
    tokens, heads, kv_heads = 37, 9, 3
    query, key = tensor(dtype, tokens, heads, head_dim, seed=1), tensor(dtype, tokens, kv_heads, head_dim, seed=2)
    angles = torch.rand(tokens, head_dim // 2) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    want_q, want_k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos[None], sin[None])
    native.rotary_(query, key, cos, sin)
    assert torch.equal(query, want_q[0].transpose(0, 1))
    assert torch.equal(key, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", BOTH)
def test_rotary_takes_views_of_one_projection_and_refuses_scattered_heads(dtype):
    """q and k as the joint projection gives them: each token's heads in one run, tokens apart."""
    tokens, head_dim = 5, 16
    joint = tensor(dtype, tokens, (4 + 2 + 2) * head_dim, seed=1)
    query, key, _ = (part.view(tokens, -1, head_dim) for part in joint.split([64, 32, 32], dim=-1))
    cos, sin = tensor(dtype, tokens, head_dim, seed=2), tensor(dtype, tokens, head_dim, seed=3)
    want_q, want_k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos[None], sin[None])
    native.rotary_(query, key, cos, sin)
    assert torch.equal(joint[:, :64].view(tokens, 4, head_dim), want_q[0].transpose(0, 1))
    assert torch.equal(joint[:, 64:96].view(tokens, 2, head_dim), want_k[0].transpose(0, 1))
    with pytest.raises(RuntimeError, match="tokens must be contiguous"):
        native.rotary_(tensor(dtype, 4, tokens, head_dim).transpose(0, 1), key, cos, sin)


@on_bf16
@pytest.mark.parametrize("width", [1536, 40, 200])  # whole passes of 128 values, a part of one, both
def test_silu_mul_matches_the_modules(width):
    """SiLU's exp is computed another way than torch's, so a bf16 result on a rounding edge may differ by one
    unit in its last place; nearly all are exact."""
    gate, up = tensor(torch.bfloat16, 300, width, scale=4, seed=1), tensor(torch.bfloat16, 300, width, seed=2)
    want = ACT2FN["silu"](gate) * up
    got = native.silu_mul(gate, up)
    assert (got == want).float().mean() > 0.999
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    joint = torch.cat([gate, up], dim=-1)
    assert torch.equal(native.silu_mul(*joint.split(width, dim=-1)), got)  # views of one projection


@pytest.mark.skipif(not (_build_runs_here(native.BF16) or _build_runs_here(native.FP32)),
                    reason="no build of kernels/csrc runs on this CPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_write_kv_fills_the_slots_and_refuses_what_it_cannot_write(dtype):
    """Either build copies any dtype; a slot outside the cache, or keys of another dtype, write nothing."""
    k_cache, v_cache = torch.zeros(2, 40, 3, 64, dtype=dtype).unbind(0)
    joint = tensor(dtype, 5, 2 * 3 * 64, seed=1)  # keys and values as views of one projection
    key, value = (part.view(5, 3, 64) for part in joint.split(3 * 64, dim=-1))
    slots = torch.tensor([7, 0, 39, 12, 13])
    native.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], key) and torch.equal(v_cache[slots], value)
    assert not k_cache[1:7].any()
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.write_kv(key * 2, value, k_cache, v_cache, torch.tensor([1, 2, 3, 4, 40]))
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    with pytest.raises(RuntimeError, match="dtype"):
        native.write_kv(key.to(other), value.to(other), k_cache, v_cache, slots)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("rows", [1, 3, 17, 32, 40])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_joint_linear_views_the_weights_and_gives_each_modules_output(tiny_model_dir, rows, dtype, batch_invariant):
    """q, k and v (Qwen2's: with biases) as one matrix: the weights laid end to end, no copy. Few rows take one
    kernel call, more rows each module; either way the outputs are the modules' own, and so are the calls the fused
    layers make (`eager`: in fp32, and in bf16 batch invariant, the kernel bound to the weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=dtype).eval()
    fast_linears(model, dtype, batch_invariant)
    attention = model.model.layers[0].self_attn
    modules = [attention.q_proj, attention.k_proj, attention.v_proj]
    joint = JointLinear(modules)
    assert joint.weight.data_ptr() == attention.q_proj.weight.data_ptr()
    assert joint.weight.shape == (sum(m.out_features for m in modules), attention.q_proj.in_features)
    x = tensor(dtype, rows, attention.q_proj.in_features, seed=rows)
    with torch.inference_mode():
        assert (joint.eager() is not joint) == (dtype == torch.float32 or batch_invariant)
        for got, eager, module in zip(joint(x), joint.eager()(x), modules, strict=True):
            assert torch.equal(got, module(x)) and torch.equal(eager, got)
            if isinstance(module, (PackedLinear, FewRowsLinear)):
                assert torch.equal(module.eager()(x), got)


@pytest.mark.parametrize("dtype", BOTH)
def test_joint_linear_of_weights_apart_runs_each_module(dtype):
    first, second = torch.nn.Linear(64, 32).to(dtype), torch.nn.Linear(64, 48).to(dtype)
    fast_linears(torch.nn.Sequential(first), dtype)
    fast_linears(torch.nn.Sequential(second), dtype)
    joint = JointLinear([first, second])
    assert joint.weight is None
    x = tensor(dtype, 2, 64)
    with torch.inference_mode():
        assert [out.shape[-1] for out in joint(x)] == [32, 48]
        assert torch.equal(joint(x)[1], second(x))


@pytest.fixture(scope="module")
def fused_models(tmp_path_factory):
    """The tiny families, and a head_dim-64 Llama whose attention runs on the native kernels."""
    root = tmp_path_factory.mktemp("fused")
    models = {family: build_tiny_model(family, root / family) for family in ("llama", "qwen2", "mistral")}
    models["llama-64"] = build_tiny_model("llama", root / "llama-64", hidden_size=384, num_attention_heads=6,
                                          num_key_value_heads=2, head_dim=64)
    return models


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "llama-64"])
def test_fused_forward_gives_transformers_logits_at_every_step(fused_models, family, dtype):
    """Two engines on one model, one fused and one on transformers' forward, fed the same requests (prompt
    chunks of up to 40 rows, past the joint linears' few rows; decodes of several sequences; blocks of 4): every
    step's logits are the same bits, and the fused engine never calls a transformers decoder layer."""
    name = str(dtype).removeprefix("torch.")
    fused = engine_for(fused_models[family], dtype=name, block_size=4, max_num_seqs=4, max_num_batched_tokens=40)
    plain = engine_for(fused_models[family], dtype=name, block_size=4, max_num_seqs=4, max_num_batched_tokens=40)
    assert isinstance(fused.runner.fused, FusedDecoder)
    plain.runner.fused = None
    layer_calls = []
    fused.runner.model.model.layers[0].register_forward_hook(lambda *args: layer_calls.append(1))
    fused_logits, plain_logits = record_logits(fused), record_logits(plain)
    for i, prompt in enumerate(random_prompts(6, seed=5, min_len=3, max_len=50)):
        fused.add(f"r{i}", greedy(prompt, 10))
        plain.add(f"r{i}", greedy(prompt, 10))
    while fused.has_work():
        fused.step()
        plain.step()
    assert not plain.has_work() and len(fused_logits) == len(plain_logits) > 10
    for step, (got, want) in enumerate(zip(fused_logits, plain_logits)):
        assert torch.equal(got, want), f"step {step}"
    assert not layer_calls


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_other_models_keep_transformers_forward(tiny_model_dir, dtype):
    engine = engine_for(tiny_model_dir("gpt2"), dtype=dtype, max_num_seqs=2)
    assert engine.runner.fused is None
    engine.add("r", greedy([5, 6, 7], 4))
    assert len(run_all(engine)["r"].token_ids) == 4


def test_the_fused_forward_names_what_keeps_it_away(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    assert "not float16 on cpu" in why_not(model, torch.device("cpu"), torch.float16)
    assert "not float32 on cuda" in why_not(model, torch.device("cuda"), torch.float32)
    model.config.hidden_act = "gelu"
    assert "SiLU-gated, not gelu" in why_not(model, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_without_the_kernels_the_engine_keeps_transformers_forward(tiny_model_dir, monkeypatch, dtype):
    monkeypatch.setattr(native, "_status", lambda build: (None, "building kernels/csrc failed: no compiler"))
    engine = engine_for(tiny_model_dir("llama"), dtype=dtype, max_num_seqs=2)
    assert engine.runner.fused is None
    engine.add("r", greedy([5, 6, 7], 4))
    assert len(run_all(engine)["r"].token_ids) == 4
