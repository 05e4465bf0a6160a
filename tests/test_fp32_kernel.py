"""The fp32 CPU kernel (`native.fp32_linear`) against torch's reference, and the engine's fp32 linears on it.

It runs only on an AVX2 CPU without AVX-512 (elsewhere MKL keeps fp32 and the kernel's tests skip); a CPU that
qualifies but fails to build it fails here.
"""

import pytest
import torch
import torch.nn.functional as F

from kernels import native
from tests.engine_helpers import engine_for, greedy, random_prompts, reference_tokens, run_all
from workers.packed_linear import FewRowsLinear, route_fp32_linears

FLAGS = native.cpu_flags()
served_here = pytest.mark.skipif(
    any(flag not in FLAGS for flag in native.FP32.cpu_flags) or any(flag in FLAGS for flag in native.FP32.excluded_by),
    reason="the fp32 kernel serves AVX2 CPUs without AVX-512")
MAX_ROWS = native.FP32_LINEAR_MAX_ROWS


def test_where_the_cpu_has_avx512_fp32_keeps_torchs_linears_without_a_warning(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    monkeypatch.setattr(native, "_status", native._status.__wrapped__)  # not the cached answer for this CPU
    with caplog.at_level("INFO", logger="kernels.native"):
        engine = engine_for(tiny_model_dir("llama"), max_num_seqs=2)
    assert "this CPU has avx512f" in native.unavailable_reason(native.FP32)
    assert not [record for record in caplog.records if record.levelname == "WARNING"]
    assert all(type(m) is torch.nn.Linear for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear))
    engine.add("r", greedy([5, 6, 7], 4))
    assert len(run_all(engine)["r"].token_ids) == 4


@served_here
def test_the_kernel_builds_on_a_cpu_it_serves():
    assert native.load(native.FP32) is not None, native.unavailable_reason(native.FP32)


def exact(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@served_here
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, MAX_ROWS])
@pytest.mark.parametrize("out_features, in_features", [(6, 8), (97, 50), (13, 3), (192, 576), (7, 1536)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fp32_linear_matches_float64(rows, out_features, in_features, with_bias):
    """Rows of x in pairs and alone; W's rows in sixes and a remainder; K with and without a tail under 8."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    y = native.fp32_linear(x, weight, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    torch.testing.assert_close(y.double(), exact(x, weight, bias), atol=1e-4 * in_features**0.5, rtol=1e-5)


@served_here
def test_leading_dimensions_and_a_strided_x_keep_their_shape():
    weight, bias = torch.randn(10, 24), torch.randn(10)
    x = torch.randn(2, 3, 48)[..., ::2]  # [2, 3, 24], not contiguous
    y = native.fp32_linear(x, weight, bias)
    assert y.shape == (2, 3, 10)
    torch.testing.assert_close(y.double(), exact(x, weight, bias), atol=1e-4, rtol=1e-5)


@served_here
@pytest.mark.parametrize("call, message", [
    (lambda: native.fp32_linear(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8), None), "1 to"),
    (lambda: native.fp32_linear(torch.randn(1, 8).double(), torch.randn(4, 8), None), "fp32 CPU tensor"),
    (lambda: native.fp32_linear(torch.randn(1, 9), torch.randn(4, 8), None), "9 features"),
    (lambda: native.fp32_linear(torch.randn(1, 8), torch.randn(8, 4).t(), None), "contiguous"),
    (lambda: native.fp32_linear(torch.randn(1, 8), torch.randn(4, 8), torch.randn(3)), "3 values"),
])
def test_fp32_linear_refuses_what_it_cannot_compute(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@served_here
def test_routing_keeps_a_tied_head_tied_copies_every_weight_and_leaves_many_rows_to_torch():
    embedding = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = embedding.weight
    model = torch.nn.ModuleDict({"embed": embedding, "up": torch.nn.Linear(16, 32), "head": head})
    plain = {name: module.weight.detach().clone() for name, module in model.items()}
    before = [parameter.data for parameter in model.parameters()]  # (held, so no address is reused)
    assert route_fp32_linears(model) == 2
    # Nothing refers to the loaded tensors any more (an fp32 checkpoint's are mapped from its file).
    storages = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    assert not storages & {tensor.untyped_storage().data_ptr() for tensor in before}
    assert route_fp32_linears(model) == 0  # routed already (a second engine on the same model)
    assert type(model["head"]) is FewRowsLinear and model["head"].weight is model["embed"].weight
    assert model["up"].weight.data_ptr() + 32 * 16 * 4 == model["head"].weight.data_ptr()  # end to end, call order
    for name, module in model.items():
        assert torch.equal(module.weight, plain[name])
    for rows in (0, 1, MAX_ROWS, MAX_ROWS + 1):  # none, the kernel's, and torch's again
        x = torch.randn(rows, 16)
        torch.testing.assert_close(model["up"](x).double(), exact(x, model["up"].weight, model["up"].bias),
                                   atol=1e-4, rtol=1e-5)


@served_here
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_fp32_engine_runs_its_linears_on_the_kernel_and_keeps_greedy_tokens(tiny_model_dir, family):
    engine = engine_for(tiny_model_dir(family), max_num_seqs=4, max_num_batched_tokens=32)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]  # GPT-2: its head
    assert engine.runner.model.get_output_embeddings() in linears
    assert all(type(m) is FewRowsLinear for m in linears)
    prompts = random_prompts(6, seed=7)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, 12))
    finals = run_all(engine)
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == reference_tokens(tiny_model_dir(family), prompt, 12)
