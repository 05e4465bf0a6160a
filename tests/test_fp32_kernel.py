"""The fp32 CPU kernels (`native.fp32_linear`, `native.paged_decode` in fp32) against torch's reference, and an
fp32 engine on them. (The layer ops are tests/test_fused_decoder.py's.)

They run on every CPU with AVX2 and FMA (elsewhere these tests skip); a CPU that has them but fails to build them
fails here.
"""

import pytest
import torch
import torch.nn.functional as F

from rqbatcher.kernels import native
from rqbatcher.kernels.attention import decode_attention
from rqbatcher.workers.model.packed_linear import FewRowsLinear, route_fp32_linears
from tests.engine_helpers import engine_for, greedy, random_prompts, reference_tokens, run_all
from tests.paged_cache import cache_slots, scattered_cache
from tests.tiny_models import build_tiny_model

FLAGS = native.cpu_flags()
served_here = pytest.mark.skipif(native.why_not_here(native.FP32, FLAGS) is not None,
                                 reason="the fp32 kernel needs AVX2 and FMA")
MAX_ROWS = native.FP32_LINEAR_MAX_ROWS


def test_a_cpu_without_avx2_keeps_torchs_fp32_linears_saying_why(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse4_2", "fma"})
    monkeypatch.setattr(native, "_status", native._status.__wrapped__)  # not the cached answer for this CPU
    with caplog.at_level("WARNING", logger="rqbatcher.kernels.native"):
        engine = engine_for(tiny_model_dir("llama"), max_num_seqs=2)
    assert native.unavailable_reason(native.FP32) == "this CPU lacks avx2"
    assert any("fp32 CPU kernels unavailable (this CPU lacks avx2)" in record.message for record in caplog.records)
    assert all(type(m) is torch.nn.Linear for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear))
    engine.add("r", greedy([5, 6, 7], 4))
    assert len(run_all(engine)["r"].token_ids) == 4


@pytest.mark.parametrize("flags", [{"avx2", "fma"}, {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"}],
                         ids=["avx2", "avx512-amx"])
def test_the_kernel_serves_every_cpu_with_avx2_and_fma(flags):
    assert native.why_not_here(native.FP32, flags) is None
    assert "lacks avx2" in str(native.why_not_here(native.FP32, flags - {"avx2"}))


@served_here
def test_the_kernel_builds_on_a_cpu_it_serves():
    assert native.load(native.FP32) is not None, native.unavailable_reason(native.FP32)


def exact(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@served_here
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 12, MAX_ROWS])
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
@pytest.mark.parametrize("out_features", [5, 97, 576])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(out_features):
    """A row alone gives the bits it gets in a pair, and beside an odd row out, at every row count (on an Intel CPU
    W's rows are read far apart up to 16 rows of x, the few left over and more rows side by side; on an AMD one
    without AVX-512 far apart at every count, 4 rows of x a pass from 3 rows): the contract batch invariance in fp32
    rests on."""
    generator = torch.Generator().manual_seed(out_features)
    x = torch.randn(MAX_ROWS, 100, generator=generator)
    weight, bias = torch.randn(out_features, 100, generator=generator), torch.randn(out_features, generator=generator)
    alone = torch.cat([native.fp32_linear(x[r : r + 1], weight, bias) for r in range(MAX_ROWS)])
    for rows in range(2, MAX_ROWS + 1):
        assert torch.equal(native.fp32_linear(x[:rows], weight, bias), alone[:rows]), rows


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


def decode_reference(query, k_cache, v_cache, tables, lens, block_size, scaling):
    return decode_attention(query.double(), k_cache.double(), v_cache.double(), cache_slots(tables, block_size), lens,
                            scaling)


@served_here
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4), (16, 2)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_decode_matches_float64(head_dim, heads, kv_heads, block_size):
    lengths = [1, 7, 8, 9, 17, 33, 300]  # within, at and past a tile of 8 keys, and many tiles
    k_cache, v_cache, tables = scattered_cache(lengths, block_size, kv_heads, head_dim)
    query = torch.randn(len(lengths), heads, head_dim)
    lens = torch.tensor(lengths)
    got = native.paged_decode(query, k_cache, v_cache, tables, lens, block_size, head_dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == query.shape
    want = decode_reference(query, k_cache, v_cache, tables, lens, block_size, head_dim**-0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@served_here
def test_the_threads_do_not_change_the_bits():
    """The build runs at::parallel_for on torch's threads (kernels/build.py::OPENMP): its splits must not move a bit."""
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(5)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((MAX_ROWS, 576), (1536, 576), (1536,)))
    k_cache, v_cache, tables = scattered_cache([1, 40, 300, 77], 16, 3, 64)
    query, lens = torch.randn(4, 9, 64, generator=generator), torch.tensor([1, 40, 300, 77])
    both = lambda: (native.fp32_linear(x, weight, bias),  # noqa: E731
                    native.paged_decode(query, k_cache, v_cache, tables, lens, 16, 0.125))
    try:
        torch.set_num_threads(1)
        one = both()
        torch.set_num_threads(2)
        assert all(torch.equal(a, b) for a, b in zip(both(), one, strict=True))
    finally:
        torch.set_num_threads(threads)


@served_here
def test_paged_decode_reads_a_query_laid_out_as_the_model_gives_it():
    k_cache, v_cache, tables = scattered_cache([40, 7], 16, 2, 64)
    query = torch.randn(1, 6, 2, 64)[0].transpose(0, 1)  # [2, 6, 64], not contiguous
    lens = torch.tensor([40, 7])
    got = native.paged_decode(query, k_cache, v_cache, tables, lens, 16, 0.125)
    assert torch.equal(got, native.paged_decode(query.contiguous(), k_cache, v_cache, tables, lens, 16, 0.125))


@served_here
def test_paged_decode_refuses_what_it_cannot_read():
    k_cache, v_cache, tables = scattered_cache([20], 16, 2, 64)
    query = torch.randn(1, 6, 64)
    with pytest.raises(RuntimeError, match="head_dim 64 and 128, not 80"):
        native.paged_decode(torch.zeros(1, 2, 80), *scattered_cache([5], 16, 2, 80), torch.tensor([5]), 16, 0.1)
    with pytest.raises(RuntimeError, match="not covered by its 2 blocks"):
        native.paged_decode(query, k_cache, v_cache, tables, torch.tensor([33]), 16, 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.paged_decode(query, k_cache, v_cache, tables + 100, torch.tensor([20]), 16, 0.1)
    with pytest.raises(RuntimeError, match="1 to 8 query heads per KV head, not 18 over 2"):
        native.paged_decode(torch.randn(1, 18, 64), k_cache, v_cache, tables, torch.tensor([20]), 16, 0.1)
    assert native.why_not(torch.device("cpu"), torch.float32, 9, 3, 64) is None
    assert (native.why_not(torch.device("cpu"), torch.float16, 9, 3, 64)
            == "they run in bfloat16 or float32, not float16")


@pytest.fixture(scope="module")
def head_dim_64_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp32-head-dim-64")
    shape = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    return {family: build_tiny_model(family, root / family, **shape) for family in ("llama", "mistral")}


@served_here
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_an_fp32_engine_decodes_on_the_kernel_and_keeps_greedy_tokens(head_dim_64_models, family, monkeypatch):
    """`auto` picks the cpu backend in fp32 here. In a real engine run (chunked prefill, blocks of 4, several
    sequences), every call of the decode kernel gets the step's decodes and answers what the reference computes
    from the same cache, and the greedy tokens are `model.generate`'s. Mistral's sliding window keeps the
    reference paths."""
    calls, kernel = [], native.paged_decode

    def checked(query, k_cache, v_cache, tables, lens, block_size, scaling):
        got = kernel(query, k_cache, v_cache, tables, lens, block_size, scaling)
        want = decode_reference(query, k_cache, v_cache, tables, lens, block_size, scaling)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        calls.append(len(lens))
        return got

    monkeypatch.setattr(native, "paged_decode", checked)
    engine = engine_for(head_dim_64_models[family], block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    assert engine.runner.native_decode and not engine.runner.native_prefill
    prompts = random_prompts(6, seed=11, min_len=5, max_len=60)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, 12))
    finals = run_all(engine)
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == reference_tokens(head_dim_64_models[family], prompt, 12)
    if family == "llama":
        assert max(calls) == 4  # the four slots' decodes in one call per layer
    else:
        assert not calls
