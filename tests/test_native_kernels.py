"""The bf16 CPU kernels (`rqbatcher.kernels.native`) against torch's reference, and the engine on the cpu backend.

They run only on a CPU with AVX-512 BF16; elsewhere these tests skip, and a CPU that has it but fails to
build them fails here.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from rqbatcher.kernels import native
from rqbatcher.kernels.attention import decode_attention, gather_blocks, prefill_attention
from rqbatcher.workers.model.packed_linear import pack_linears
from tests.engine_helpers import engine_for, greedy, random_prompts, run_all
from tests.paged_cache import cache_slots
from tests.paged_cache import scattered_cache as any_scattered_cache
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(any(flag not in native.cpu_flags() for flag in native.BF16.cpu_flags),
                                reason="this CPU has no AVX-512 BF16")
BF16_TOLERANCE = dict(atol=2e-2, rtol=2e-2)
scattered_cache = functools.partial(any_scattered_cache, dtype=torch.bfloat16)


def test_the_kernels_build_on_a_cpu_that_has_the_instructions():
    assert native.load() is not None, native.unavailable_reason()


DECODE_KERNELS = ["paged_decode",
                  pytest.param("amx_decode", marks=pytest.mark.skipif(not native.cpu_has_amx(), reason="no AMX"))]


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4), (16, 2)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_decode_matches_the_reference(kernel, head_dim, heads, kv_heads, block_size):
    lengths = [1, 15, 16, 17, 33, 300]  # within, at and past a tile of 16 keys, and many tiles
    k_cache, v_cache, tables = scattered_cache(lengths, block_size, kv_heads, head_dim)
    query = torch.randn(len(lengths), heads, head_dim).to(torch.bfloat16)
    lens = torch.tensor(lengths)
    got = getattr(native.load(), kernel)(query, k_cache, v_cache, tables, lens, block_size, head_dim**-0.5)
    slots = cache_slots(tables, block_size)
    want = decode_attention(query.float(), k_cache.float(), v_cache.float(), slots, lens, head_dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
@pytest.mark.parametrize("lengths", [[900, 3, 5, 2, 1, 4, 700], [300], [40, 7]])
def test_paged_decode_splits_its_work_by_keys_over_any_threads_without_moving_a_bit(kernel, lengths):
    """Threads take runs of decodes of about equal keys (kernels/csrc/decode_call.h): one long decode among short
    ones, fewer units than threads, or more threads than cores must each compute every output once, the same bits
    as one thread."""
    k_cache, v_cache, tables = scattered_cache(lengths, 16, 3, 64)
    query, lens = torch.randn(len(lengths), 9, 64).to(torch.bfloat16), torch.tensor(lengths)
    run = lambda: getattr(native.load(), kernel)(query, k_cache, v_cache, tables, lens, 16, 0.125)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        for count in (2, 3, 5):
            torch.set_num_threads(count)
            assert torch.equal(run(), one), f"{count} threads"
    finally:
        torch.set_num_threads(threads)
    want = decode_attention(query.float(), k_cache.float(), v_cache.float(), cache_slots(tables, 16), lens, 0.125)
    torch.testing.assert_close(one.float(), want, **BF16_TOLERANCE)


def test_paged_decode_reads_a_query_laid_out_as_the_model_gives_it():
    """The model hands attention a transposed view (`[T, H, D]` of `[1, H, T, D]`); the kernel must not
    read it as if it were contiguous."""
    k_cache, v_cache, tables = scattered_cache([40, 7], 16, 2, 64)
    query = torch.randn(1, 6, 2, 64).to(torch.bfloat16)[0].transpose(0, 1)  # [2, 6, 64], not contiguous
    lens = torch.tensor([40, 7])
    got = native.paged_decode(query, k_cache, v_cache, tables, lens, 16, 0.125)
    want = native.paged_decode(query.contiguous(), k_cache, v_cache, tables, lens, 16, 0.125)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_paged_decode_refuses_what_it_does_not_support(kernel):
    decode = getattr(native.load(), kernel)
    k_cache, v_cache, tables = scattered_cache([5], 16, 1, 80)
    with pytest.raises(RuntimeError, match="head_dim 64 and 128, not 80"):
        decode(torch.zeros(1, 1, 80, dtype=torch.bfloat16), k_cache, v_cache, tables, torch.tensor([5]), 16, 0.1)
    with pytest.raises(RuntimeError, match="bf16 CPU tensor"):
        decode(torch.zeros(1, 1, 80, dtype=torch.bfloat16), k_cache.float(), v_cache, tables, torch.tensor([5]), 16,
               0.1)
    k_cache, v_cache, tables = scattered_cache([20], 16, 2, 64)
    query = torch.randn(1, 6, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="not covered by its 2 blocks"):
        decode(query, k_cache, v_cache, tables, torch.tensor([33]), 16, 0.1)
    with pytest.raises(RuntimeError, match="block 1\\d\\d is outside the cache"):
        decode(query, k_cache, v_cache, tables + 100, torch.tensor([20]), 16, 0.1)
    with pytest.raises(RuntimeError, match="1 to 8 query heads per KV head, not 18 over 2"):
        decode(torch.randn(1, 18, 64).to(torch.bfloat16), k_cache, v_cache, tables, torch.tensor([20]), 16, 0.1)
    assert native.why_not(torch.device("cpu"), torch.bfloat16, 10, 2, 80) == "head_dim 80 is not one of (64, 128)"
    assert native.why_not(torch.device("cpu"), torch.bfloat16, 9, 3, 64) is None


def test_a_cpu_without_avx2_refuses_fp32_decode_attention_saying_why(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: set(native.BF16.cpu_flags) - {"avx2"} | {"fma"})
    monkeypatch.setattr(native, "_status", native._status.__wrapped__)  # not the cached answer for this CPU
    k_cache, v_cache, tables = scattered_cache([5], 16, 1, 64)
    with pytest.raises(RuntimeError, match=r"the fp32 CPU kernels cannot run here: this CPU lacks avx2"):
        native.paged_decode(torch.zeros(1, 1, 64), k_cache.float(), v_cache.float(), tables, torch.tensor([5]), 16,
                            0.1)
    assert native.why_not(torch.device("cpu"), torch.float32, 9, 3, 64) == "this CPU lacks avx2"


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("features", [576, 50, 1536])  # 50: a tail shorter than one vector
@pytest.mark.parametrize("with_bias", [True, False])
def test_small_linear_matches_the_reference(rows, features, with_bias):
    x = torch.randn(1, rows, features).to(torch.bfloat16)
    weight = (torch.randn(97, features) / features**0.5).to(torch.bfloat16)  # odd: a last row on its own
    bias = torch.randn(97).to(torch.bfloat16) if with_bias else None
    got = native.small_linear(x, weight, bias)
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.shape == (1, rows, 97) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)


def test_small_linear_takes_at_most_its_rows():
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        native.small_linear(torch.zeros(5, 32, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16), None)


def prefill_reference(query, k_cache, v_cache, table, ctx_start, block_size):
    length = ctx_start + query.shape[0]
    keys = gather_blocks(k_cache, table, block_size)[:length].float()
    values = gather_blocks(v_cache, table, block_size)[:length].float()
    return prefill_attention(query.float(), keys, values, ctx_start, query.shape[-1] ** -0.5)


def kernel_on(isa, op):
    """The kernel `op` ("prefill", "linear") on `isa` ("amx" or "avx512"), skipping where this CPU cannot run it."""
    if isa == "amx" and not native.cpu_has_amx():
        pytest.skip("this CPU has no AMX")
    return getattr(native.load(), f"{isa}_{op}")


@pytest.mark.parametrize("kernel", ["amx", "avx512"])
@pytest.mark.parametrize("ctx_start,n", [(0, 1), (0, 37), (5, 1), (20, 16), (31, 33), (300, 64)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_prefill_matches_the_reference(kernel, ctx_start, n, heads, kv_heads, head_dim, block_size):
    """A chunk after any number of cached keys (none, part of a tile, many tiles), of any length."""
    k_cache, v_cache, tables = scattered_cache([ctx_start + n], block_size, kv_heads, head_dim)
    query = torch.randn(n, heads, head_dim).to(torch.bfloat16)
    got = kernel_on(kernel, "prefill")(query, k_cache, v_cache, tables[0], ctx_start, block_size, head_dim**-0.5)
    assert got.shape == query.shape and got.dtype == torch.bfloat16
    want = prefill_reference(query, k_cache, v_cache, tables[0], ctx_start, block_size)
    torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)


def test_prefill_reads_a_query_laid_out_as_the_model_gives_it():
    k_cache, v_cache, tables = scattered_cache([50], 16, 2, 64)
    query = torch.randn(1, 6, 20, 64).to(torch.bfloat16)[0].transpose(0, 1)  # [20, 6, 64], not contiguous
    got = native.prefill(query, k_cache, v_cache, tables[0], 30, 16, 0.125)
    assert torch.equal(got, native.prefill(query.contiguous(), k_cache, v_cache, tables[0], 30, 16, 0.125))


@pytest.mark.parametrize("kernel", ["amx", "avx512"])
def test_prefill_refuses_what_it_does_not_support(kernel):
    k_cache, v_cache, tables = scattered_cache([40], 16, 2, 64)
    query = torch.randn(8, 4, 64).to(torch.bfloat16)
    prefill = kernel_on(kernel, "prefill")
    with pytest.raises(RuntimeError, match="does not cover the chunk"):
        prefill(query, k_cache, v_cache, tables[0][:1], 32, 16, 0.125)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128, not 32"):
        prefill(query[..., :32], k_cache, v_cache, tables[0], 0, 16, 0.125)
    outside = tables[0].clone()
    outside[1] = k_cache.shape[0] // 16  # one block past the cache's last
    with pytest.raises(RuntimeError, match="outside the cache"):
        prefill(query, k_cache, v_cache, outside, 32, 16, 0.125)


@pytest.mark.parametrize("amx", [True, False])
def test_packed_model_streams_one_buffer_and_keeps_its_tie(tiny_model_dir, monkeypatch, amx):
    """The few rows of a decode run on the copy of the weights in tile order (on AMX where the CPU has it, else
    on AVX-512), one row on the plain weights; either copy is laid end to end in call order, and the result is
    the plain model's."""
    from transformers import AutoModelForCausalLM

    if amx and not native.cpu_has_amx():
        pytest.skip("this CPU has no AMX")
    monkeypatch.setattr(native, "has_amx", lambda: amx)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.bfloat16).eval()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        plain = model(ids).logits
        pack_linears(model, few_rows_native=True)
        packed = model(ids).logits  # 4 rows: tile_linear's path
        one_row = model(ids[:, :1]).logits  # small_linear's path
    attention = model.model.layers[0].self_attn
    for copy in ["weight", "tile_weight"]:
        q, k = getattr(attention.q_proj, copy), getattr(attention.k_proj, copy)
        assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()  # end to end, in call order
    assert attention.q_proj.small_rows
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(packed.float(), plain.float(), atol=0.1, rtol=0.05)
    torch.testing.assert_close(one_row.float(), plain[:, :1].float(), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("kernel", ["amx", "avx512"])
# avx512: 12 rows at a time, so 13 take two passes; amx: 32 at a time; a prefill's many rows (batch invariance)
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("features", [576, 50])
@pytest.mark.parametrize("out_features", [97, 32])  # 97: a lone last block of 16; 32: one pair of blocks
def test_tile_linear_matches_the_reference(kernel, rows, features, out_features):
    linear = kernel_on(kernel, "linear")
    x = torch.randn(1, rows, features).to(torch.bfloat16)
    weight = (torch.randn(out_features, features) / features**0.5).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    packed = native.tile_pack(weight)
    got = linear(x, packed, bias, out_features)
    want = F.linear(x.float(), weight.float(), bias.float())
    assert got.shape == (1, rows, out_features)
    torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)
    torch.testing.assert_close(linear(x, packed, None, out_features).float(), want - bias.float(), **BF16_TOLERANCE)
    assert linear(x[:, :0], packed, None, out_features).shape == (1, 0, out_features)
    with pytest.raises(RuntimeError, match="does not fit x"):
        linear(torch.zeros(2, features + 32, dtype=torch.bfloat16), packed, None, out_features)


@pytest.fixture(scope="module")
def head_dim_64_models(tmp_path_factory):
    """Tiny models whose heads the decode kernel takes: head_dim 64, three query heads per KV head (SmolLM2's
    shape), and Mistral's sliding window, which the kernel leaves to the reference."""
    root = tmp_path_factory.mktemp("head-dim-64")
    shape = dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    return {"llama": build_tiny_model("llama", root / "llama", **shape),
            "mistral": build_tiny_model("mistral", root / "mistral", **shape)}


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_cpu_backend_serves_decodes_and_prompt_chunks(head_dim_64_models, family, monkeypatch):
    """In a real engine run (chunked prefill, blocks of 4, several sequences), each call of the decode kernel
    gets the step's decodes, each call of the prefill kernel a chunk, and both return what the reference
    computes from the same cache; a bf16 run cannot be held to token equality (near ties flip), so the
    kernels' every answer is checked instead."""
    calls = []
    kernel = native.paged_decode

    def checked(query, k_cache, v_cache, tables, lens, block_size, scaling):
        got = kernel(query, k_cache, v_cache, tables, lens, block_size, scaling)
        slots = cache_slots(tables, block_size)
        want = decode_attention(query.float(), k_cache.float(), v_cache.float(), slots, lens, scaling)
        torch.testing.assert_close(got.float(), want, **BF16_TOLERANCE)
        calls.append(len(lens))
        return got

    def checked_prefill(query, k_cache, v_cache, table, ctx_start, block_size, scaling):
        got = prefill(query, k_cache, v_cache, table, ctx_start, block_size, scaling)
        torch.testing.assert_close(got.float(), prefill_reference(query, k_cache, v_cache, table, ctx_start,
                                                                  block_size), **BF16_TOLERANCE)
        chunks.append(ctx_start)
        return got

    chunks = []
    prefill = native.prefill
    monkeypatch.setattr(native, "paged_decode", checked)
    monkeypatch.setattr(native, "prefill", checked_prefill)
    # a small cache: each check reads all of it in fp32
    engine = engine_for(head_dim_64_models[family], dtype="bfloat16", attention_backend="cpu", block_size=4,
                        max_num_seqs=4, max_num_batched_tokens=32, num_blocks=96)
    prompts = random_prompts(6, seed=11, min_len=5, max_len=60)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, 12))
    finals = run_all(engine)
    assert sorted(len(out.token_ids) for out in finals.values()) == [12] * 6
    if family == "llama":
        assert max(calls) == 4  # the four slots' decodes in one call per layer
        assert 0 in chunks and max(chunks) > 0  # first chunks and later ones
    else:
        assert not calls and not chunks  # a sliding window: the reference paths


def test_auto_picks_the_cpu_backend_in_either_dtype(head_dim_64_models):
    """Every CPU these tests run on (AVX-512 BF16) has the fp32 build's AVX2 and FMA too."""
    assert engine_for(head_dim_64_models["llama"], dtype="bfloat16").runner.native_decode
    assert engine_for(head_dim_64_models["llama"], dtype="float32").runner.native_decode


def test_an_engine_where_the_kernels_cannot_load_runs_torch_paths(head_dim_64_models, monkeypatch):
    """No compiler, or a failed build: `auto` keeps torch's kernels, an explicit `cpu` is refused with the
    reason, and nothing calls the extension."""
    from rqbatcher.workers.model.attention_backend import AttentionBackendError

    monkeypatch.setattr(native, "_status", lambda build: (None, "building kernels/csrc failed: no compiler"))
    engine = engine_for(head_dim_64_models["llama"], dtype="bfloat16", max_num_seqs=2)
    assert not engine.runner.native_decode
    linear = engine.runner.model.model.layers[0].self_attn.q_proj
    assert linear.tile_weight is None and not linear.small_rows
    engine.add("r", greedy([5, 6, 7], 4))
    assert len(run_all(engine)["r"].token_ids) == 4
    with pytest.raises(AttentionBackendError, match="no compiler"):
        engine_for(head_dim_64_models["llama"], dtype="bfloat16", attention_backend="cpu")


def test_a_linear_of_no_rows_gives_no_rows():
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    pack_linears(torch.nn.Sequential(layer), few_rows_native=True)
    assert layer(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 32)


def test_a_second_engine_on_a_packed_model_runs():
    """`batcher demo --compare` builds a static engine on the continuous one's (packed) model."""
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    model = torch.nn.Sequential(layer)
    assert pack_linears(model, few_rows_native=True) == 1
    assert pack_linears(model, few_rows_native=True) == 0
    x = torch.randn(2, 64).to(torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()),
                               **BF16_TOLERANCE)

