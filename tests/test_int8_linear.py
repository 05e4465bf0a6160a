"""int8 weights (`--quantization int8`, `workers.model.int8_linear`): the arithmetic, the modules replaced, the
quantized model's logits against the float model's, an engine serving on them (batch invariant), and the option.

The torch reference runs everywhere; where `rqbatcher.kernels.native`'s int8 kernel loads, its output is checked
against the reference, whose bits it gives (skipped elsewhere)."""

import copy

import click
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from rqbatcher.cli.options import engine_options
from rqbatcher.config import QUANTIZATIONS, EngineConfig
from rqbatcher.kernels import native
from rqbatcher.workers.model import int8_linear
from rqbatcher.workers.model.fused_decoder import why_not
from rqbatcher.workers.model.int8_linear import (
    QUANT_MAX,
    ROTATION,
    Int8JointLinear,
    Int8Linear,
    int8_linear_reference,
    joint_linear,
    native_int8,
    quantize_activations,
    quantize_linears,
    quantize_weight,
    rotate,
)
from tests.engine_helpers import engine_for, generate_greedy, greedy, random_prompts, record_logits, run_all
from tests.test_int8_kernel import int8_unpack
from tests.tiny_models import build_tiny_model

LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
MAX_TOKENS = 10


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def weights_and_input(out_features=70, features=100, rows=9):
    """A weight whose rows differ in scale by 1000x (and one row all zeros), K not a whole number of rotation
    blocks."""
    weight = randn(out_features, features, seed=1) * torch.logspace(-2, 1, out_features)[:, None]
    weight[5] = 0
    x = randn(rows, features, seed=2) * torch.logspace(-1, 2, rows)[:, None]
    x[3] = 0
    return weight, x, randn(out_features, seed=3)


@pytest.mark.parametrize("layout", ["float32", "bfloat16", "transposed"])
def test_quantize_weight_gives_the_same_bits_whatever_rows_it_takes_at_once(monkeypatch, layout):
    """A weight is quantized a few rows at a time (WEIGHT_CHUNK_ELEMENTS): each row's clip and integers depend on
    that row alone, so chunks of any size (an uneven last one too) give one quantization's bits."""
    weight, _, _ = weights_and_input()
    if layout == "bfloat16":
        weight = weight.bfloat16()
    elif layout == "transposed":  # GPT-2's Conv1D weight, quantized as its transpose (a strided view)
        weight = weight.t().contiguous().t()
    monkeypatch.setattr(int8_linear, "WEIGHT_CHUNK_ELEMENTS", weight.numel())
    whole = quantize_weight(weight)
    monkeypatch.setattr(int8_linear, "WEIGHT_CHUNK_ELEMENTS", 3 * weight.shape[1])  # 70 rows: 23 of 3, then 1
    chunked = quantize_weight(weight)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert chunked[0].is_contiguous() and chunked[0].dtype == torch.int8


def test_quantize_weight_round_trips_within_half_a_step_per_channel_inside_its_clip():
    weight, _, _ = weights_and_input()
    qweight, wscale = quantize_weight(weight)
    assert qweight.dtype == torch.int8 and qweight.is_contiguous() and qweight.shape == weight.shape
    assert wscale.dtype == torch.float32 and wscale.shape == (weight.shape[0],)
    assert wscale[5] == 0 and not qweight[5].any()
    nonzero = torch.arange(weight.shape[0]) != 5
    assert (qweight[nonzero].abs().amax(dim=1) == QUANT_MAX).all()
    inside = weight.abs() <= wscale[:, None] * QUANT_MAX
    error = (qweight.float() * wscale[:, None] - weight).abs()
    assert (error[inside] <= (wscale[:, None] * (0.5 + 1e-4)).expand_as(error)[inside]).all()
    assert (wscale <= weight.abs().amax(dim=1) / QUANT_MAX).all()


def test_each_rows_clip_gives_no_more_squared_error_than_its_max_and_less_on_long_rows():
    """A long Gaussian row's few largest weights stretch the step of all the others: clipping them pays."""
    weight = torch.randn(64, 4096, generator=torch.Generator().manual_seed(3))
    qweight, wscale = quantize_weight(weight)
    absmax = weight.abs().amax(dim=1) / QUANT_MAX
    plain = (torch.round(weight / absmax[:, None]).clamp(-QUANT_MAX, QUANT_MAX) * absmax[:, None] - weight).square()
    chosen = (qweight.float() * wscale[:, None] - weight).square()
    assert (chosen.sum(dim=1) <= plain.sum(dim=1) * (1 + 1e-6)).all()
    assert (wscale < absmax).float().mean() > 0.9 and chosen.sum() < 0.99 * plain.sum()


def test_rotating_both_operands_keeps_their_dot_products():
    """`rotate` is sqrt(ROTATION) times an orthogonal map on K's whole blocks (zeros past K), so rotate(x) .
    rotate(w) / ROTATION is x . w; and it mixes each block's values, so one large value spreads over its block."""
    weight, x, _ = weights_and_input()
    rotated_x, rotated_w = rotate(x), rotate(weight)
    assert rotated_x.shape == (x.shape[0], 128) and rotated_w.shape == (weight.shape[0], 128)
    exact = x.double() @ weight.double().T
    torch.testing.assert_close(rotated_x.double() @ rotated_w.double().T / ROTATION, exact,  # to float32's rounding
                               rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    spike = torch.zeros(1, ROTATION)
    spike[0, 9] = 8.0
    assert torch.equal(rotate(spike).abs(), torch.full((1, ROTATION), 8.0))  # one value, in every place at 1/8th


def test_the_reference_is_the_dequantized_matmul():
    """The exact integer sums, then the scales: a float64 matmul of the dequantized rotated operands gives the same
    figures to float32's rounding, and a float matmul of the float operands within the quantization's error."""
    weight, x, bias = weights_and_input()
    qweight, wscale = quantize_weight(weight, rotated=True)
    assert qweight.shape == (weight.shape[0], 128)  # K = 100 rotated in two blocks of 64
    y = int8_linear_reference(x, qweight, wscale, bias)
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], weight.shape[0])
    qx, sx = quantize_activations(x)
    assert qx.shape == (x.shape[0], 128) and sx.shape == (x.shape[0],)
    x_dequantized = qx.double() * sx.double()[:, None]
    expected = x_dequantized @ (qweight.double() * wscale.double()[:, None]).T + bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(y[3], bias)  # a row of zeros
    assert torch.equal(y[:, 5], bias[5].expand(x.shape[0]))  # a weight row of zeros
    exact = x @ weight.T + bias
    assert ((y - exact).norm() / exact.norm()) < 0.02


def test_a_row_and_a_column_of_the_reference_do_not_depend_on_the_others():
    """Batch invariance, bit for bit: a row alone or among others, a column alone or joined with others."""
    weight, x, bias = weights_and_input()
    qweight, wscale = quantize_weight(weight, rotated=True)
    full = int8_linear_reference(x, qweight, wscale, bias)
    for start, rows in [(0, 1), (8, 1), (2, 5)]:
        assert torch.equal(int8_linear_reference(x[start : start + rows], qweight, wscale, bias),
                           full[start : start + rows])
    assert torch.equal(int8_linear_reference(x, qweight[10:30], wscale[10:30], bias[10:30]), full[:, 10:30])
    assert int8_linear_reference(x[:0], qweight, wscale, bias).shape == (0, weight.shape[0])


def int8_weight(module: Int8Linear) -> torch.Tensor:
    """A layer's int8 [out, in] matrix, whatever the layout it keeps it in."""
    if not module.on_native:
        return module.qweight
    return int8_unpack(module.qweight, module.out_features, module.qweight.shape[1] // native.INT8_TILE)


NATIVE = native_int8(torch.device("cpu"))
on_native_here = pytest.mark.skipif(not NATIVE, reason="kernels.native's int8 kernel does not load here (not built, "
                                                       "or this CPU lacks its instructions)")


@on_native_here
def test_the_native_kernel_gives_the_references_bits_on_the_weight_kept_packed():
    weight, x, bias = weights_and_input(out_features=200, features=576, rows=40)
    qweight, wscale = quantize_weight(weight, rotated=True)
    module = Int8Linear(qweight, wscale, bias)
    assert module.on_native and module.qweight.dtype == torch.uint8  # the kernel's layout only
    assert torch.equal(int8_weight(module), qweight)
    for rows in (1, 4, 40):
        assert torch.equal(module(x[:rows]), int8_linear_reference(x[:rows], qweight, wscale, bias))
    assert module(x[:0]).shape == (0, 200)  # no rows: the reference, on the weight unpacked


@on_native_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_forward_runs_the_native_kernel_with_its_bits(monkeypatch, dtype):
    weight, x, bias = weights_and_input(out_features=200, features=576, rows=4)
    module = Int8Linear(*quantize_weight(weight, rotated=True), bias)
    x = x.to(dtype)
    eager = module(x)
    calls, kernel = [], native.int8_linear
    monkeypatch.setattr(native, "int8_linear", lambda *args: calls.append(args[0].shape) or kernel(*args))
    assert torch.equal(torch.compile(module, fullgraph=True)(x), eager)
    assert calls == [x.shape]  # the kernel ran: not the reference, traced into the graph


def test_a_module_keeps_its_input_dtype_and_shape():
    weight, x, bias = weights_and_input()
    module = Int8Linear(*quantize_weight(weight, rotated=True), bias, on_native=False)
    assert not any(p.numel() for p in module.parameters())  # buffers only: no float weight is kept
    y = module(x.view(3, 3, -1).to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 3, weight.shape[0])
    expected = int8_linear_reference(x.to(torch.bfloat16).float(), module.qweight, module.wscale, bias)
    assert torch.equal(y.view(9, -1), expected.to(torch.bfloat16))


def load(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("on_native", [False, pytest.param(True, marks=on_native_here)])
def test_every_linear_of_the_layers_and_the_lm_head_is_replaced_and_the_embedding_stays(tiny_model_dir, family,
                                                                                         on_native):
    model = load(tiny_model_dir(family))
    embedding = model.model.embed_tokens.weight.clone()
    layers = model.config.num_hidden_layers
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {name: quantize_weight(m.weight, rotated=True)[0] for name, m in linears.items()}
    assert quantize_linears(model, on_native=on_native) == layers * LINEARS_PER_LAYER + 1
    assert not [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        modules = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj]
        assert all(isinstance(m, Int8Linear) and m.on_native == on_native for m in modules)
        assert (attention.q_proj.bias is not None) == (family == "qwen2")  # Qwen2's q/k/v biases are kept
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.out_features == model.config.vocab_size
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    int8 = {name: m for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert int8.keys() == expected.keys() and all(torch.equal(int8_weight(m), expected[n]) for n, m in int8.items())
    assert len({m.qweight.untyped_storage().data_ptr() for m in int8.values()}) == 1  # laid end to end
    assert quantize_linears(model) == 0  # quantized already


def test_a_tied_lm_head_gets_its_own_int8_copy(tmp_path):
    model = load(build_tiny_model("llama", tmp_path / "tied", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight
    quantize_linears(model, on_native=False)
    assert isinstance(model.lm_head, Int8Linear) and model.model.embed_tokens.weight is embedding
    assert embedding.dtype == torch.float32
    assert torch.equal(model.lm_head.qweight, quantize_weight(embedding, rotated=True)[0])


def test_gpt2s_conv1d_layers_are_quantized_as_their_transpose(tiny_model_dir):
    model = load(tiny_model_dir("gpt2"))
    c_attn = model.transformer.h[0].attn.c_attn
    expected = quantize_weight(c_attn.weight.t(), rotated=True)
    ids = torch.tensor([[5, 17, 99, 3]])
    before = model(ids).logits
    quantize_linears(model, on_native=False)
    assert not [m for m in model.modules() if isinstance(m, (Conv1D, torch.nn.Linear))]
    assert torch.equal(model.transformer.h[0].attn.c_attn.qweight, expected[0])
    after = model(ids).logits
    assert (after - before).norm() / before.norm() < 0.05


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_quantized_models_logits_stay_close_to_the_float_models(tiny_model_dir, family):
    model = load(tiny_model_dir(family))
    quantized = copy.deepcopy(model)
    quantize_linears(quantized, on_native=False)
    ids = torch.tensor(random_prompts(3, seed=1, min_len=30, max_len=30))
    with torch.inference_mode():
        exact, approximate = model(ids).logits, quantized(ids).logits
    assert (approximate - exact).norm() / exact.norm() < 0.03
    agree = (approximate.argmax(-1) == exact.argmax(-1)).float().mean()
    assert agree > 0.9


@pytest.mark.parametrize("on_native", [False, pytest.param(True, marks=on_native_here)])
def test_joint_calls_give_each_modules_bits(tiny_model_dir, on_native):
    model = load(tiny_model_dir("qwen2"))
    quantize_linears(model, on_native=on_native)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    x = randn(5, model.config.hidden_size, seed=4)
    for modules in ([attention.q_proj, attention.k_proj, attention.v_proj], [mlp.gate_proj, mlp.up_proj]):
        joint = joint_linear(modules)
        assert isinstance(joint, Int8JointLinear) and joint.qweight is not None
        for got, module in zip(joint(x), modules, strict=True):
            assert torch.equal(got, module(x))


@on_native_here
def test_packed_parts_run_as_one_call_only_where_each_ends_on_a_whole_tile():
    def laid_end_to_end(sizes: tuple[int, ...]) -> list[Int8Linear]:
        modules = [Int8Linear(*quantize_weight(randn(n, 40, seed=n), rotated=True), randn(n, seed=n + 1),
                              on_native=True)
                   for n in sizes]
        buffer, offset = torch.empty(sum(m.qweight.numel() for m in modules), dtype=torch.uint8), 0
        for m in modules:
            m.qweight = buffer[offset : offset + m.qweight.numel()].view_as(m.qweight).copy_(m.qweight)
            offset += m.qweight.numel()
        return modules

    x = randn(3, 40, seed=9)
    for sizes, as_one in (((16, 32, 5), True), ((5, 16), False), ((8, 16), False)):  # a part ending inside a tile
        modules = laid_end_to_end(sizes)
        joint = Int8JointLinear(modules)
        assert (joint.qweight is not None) == as_one
        for got, eager, module in zip(joint(x), joint.eager()(x), modules, strict=True):
            assert torch.equal(got, module(x)) and torch.equal(eager, got)
        for module in modules:  # the kernel bound to the weights, for the fused layers
            assert torch.equal(module.eager()(x.bfloat16()), module(x.bfloat16()))


def test_the_eager_call_of_a_layer_off_the_kernel_is_its_own_forward():
    modules = [Int8Linear(*quantize_weight(randn(n, 40, seed=n), rotated=True), None, on_native=False)
               for n in (16, 32)]
    joint = Int8JointLinear(modules)
    assert joint.eager() is joint and modules[0].eager() == modules[0].forward


def test_an_engine_serves_on_int8_weights(tiny_model_dir):
    """Several greedy requests at once, each token that of the quantized model's own greedy generate."""
    model_dir = tiny_model_dir("llama")
    engine = engine_for(model_dir, quantization="int8", max_num_seqs=4)
    assert engine.stats().quantization == "int8"
    assert isinstance(engine.runner.model.lm_head, Int8Linear)
    assert not [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    prompts = random_prompts(6, seed=7, min_len=3, max_len=30)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, MAX_TOKENS))
    finals = run_all(engine)
    reference = load(model_dir)
    quantize_linears(reference, on_native=engine.runner.model.lm_head.on_native)
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == generate_greedy(reference, prompt, MAX_TOKENS), i


@pytest.fixture(scope="module")
def invariance_model(tmp_path_factory):
    """SmolLM2's head shape (head_dim 64, 3 query heads per KV head), as tests/test_batch_invariance.py builds it."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("int8-invariance") / "llama", hidden_size=384,
                            num_attention_heads=6, num_key_value_heads=2, head_dim=64)


def target_tokens(model_dir, target, others=(), **knobs) -> list[int]:
    engine = engine_for(model_dir, quantization="int8", **knobs)
    engine.add("target", greedy(target, MAX_TOKENS))
    for i, prompt in enumerate(others):
        engine.add(f"other{i}", greedy(prompt, MAX_TOKENS + 3 * i))
    return run_all(engine)["target"].token_ids


def test_a_requests_int8_tokens_do_not_depend_on_what_runs_beside_it(invariance_model):
    """Alone; among 7 others in chunks of a small token budget (its prompt split, decodes beside prompt chunks)."""
    target, *others = random_prompts(8, seed=3, min_len=40, max_len=40)
    alone = target_tokens(invariance_model, target, max_num_batched_tokens=512)
    assert target_tokens(invariance_model, target, others, max_num_seqs=8, max_num_batched_tokens=23,
                         block_size=4) == alone
    assert target_tokens(invariance_model, target, others, max_num_seqs=8, max_num_batched_tokens=64,
                         prefix_caching=False) == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_layers_run_on_the_int8_modules_with_transformers_logits(invariance_model, monkeypatch, dtype):
    """Where the fused forward serves (the layer kernels of `dtype` load), it runs the int8 modules' weights, q/k/v
    and gate/up as one int8 call each (on the native kernel, bound to the weights): every step's logits are the bits
    of transformers' forward on the same modules."""
    knobs = dict(dtype=dtype, quantization="int8", block_size=4, max_num_seqs=4, max_num_batched_tokens=40)
    fused = engine_for(invariance_model, **knobs)
    if fused.runner.fused is None:
        pytest.skip(f"the fused layers do not serve {dtype} here: "
                    f"{why_not(fused.runner.model, torch.device('cpu'), fused.runner.dtype)}")
    plain = engine_for(invariance_model, **knobs)
    plain.runner.fused = None
    calls, kernels = [], native.load(native.INT8)
    if kernels is not None:
        kernel = kernels.int8_linear
        monkeypatch.setattr(kernels, "int8_linear", lambda *args: calls.append(args[0].shape) or kernel(*args))
    fused_logits, plain_logits = record_logits(fused), record_logits(plain)
    for i, prompt in enumerate(random_prompts(6, seed=5, min_len=3, max_len=50)):
        fused.add(f"r{i}", greedy(prompt, MAX_TOKENS))
        plain.add(f"r{i}", greedy(prompt, MAX_TOKENS))
    per_step = []
    while fused.has_work():
        before = len(calls)
        fused.step()
        per_step.append(len(calls) - before)
        plain.step()
    assert not plain.has_work() and len(fused_logits) == len(plain_logits) > MAX_TOKENS
    if kernels is not None:  # 4 per layer, and the LM head where a row samples
        layers = 4 * len(fused.runner.fused.layers)
        assert set(per_step) <= {layers, layers + 1} and layers + 1 in per_step
    for step, (got, want) in enumerate(zip(fused_logits, plain_logits)):
        assert torch.equal(got, want), f"step {step}"


def test_an_unknown_quantization_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"^quantization must be one of none, int8, got 'int4'$"):
        EngineConfig(quantization="int4")
    assert EngineConfig().quantization == "none" and QUANTIZATIONS == ("none", "int8")


@click.command()
@engine_options
def show(engine_config):
    click.echo(engine_config.quantization)


def test_the_option_and_its_variable_parse():
    runner = CliRunner()
    assert runner.invoke(show, []).output.strip() == "none"
    assert runner.invoke(show, ["--quantization", "int8"]).output.strip() == "int8"
    assert runner.invoke(show, [], env={"BATCHER_QUANTIZATION": "int8"}).output.strip() == "int8"
    refused = runner.invoke(show, ["--quantization", "int4"])
    assert refused.exit_code == 2 and "'int4' is not one of 'none', 'int8'" in refused.output
