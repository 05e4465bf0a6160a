"""Batch invariance: a request's tokens do not depend on what else runs (docs/batch-invariance.md).

In fp32 everywhere, and in bf16 where `rqbatcher.kernels.native`'s bf16 kernels run (a CPU with AVX-512 BF16; skipped
elsewhere, where bf16 is not batch invariant). The kernel tests check the mechanism bit for bit: a linear's row
at any row count, and a query's attention as a decode and in any prompt chunk. The engine tests check the
contract: one greedy request alone, among others in chunked steps, after a prefix-cache hit and after
preemption gives the same tokens.
"""

import pytest
import torch

from rqbatcher.kernels import native
from tests.engine_helpers import engine_for, greedy, random_prompts, run_all, run_counting_preemptions
from tests.paged_cache import scattered_cache
from tests.tiny_models import build_tiny_model

NO_BF16_KERNELS = any(flag not in native.cpu_flags() for flag in native.BF16.cpu_flags)
needs_bf16_kernels = pytest.mark.skipif(NO_BF16_KERNELS, reason="this CPU has no AVX-512 BF16: kernels.native's bf16 "
                                        "kernels do not run, and bf16 is not batch invariant here")


def tile_linear_kernel(isa):
    """`tile_linear` on `isa` ("amx" or "avx512"), skipping where this CPU cannot run it."""
    if isa == "amx" and not native.cpu_has_amx():
        pytest.skip("this CPU has no AMX")
    return getattr(native.load(), f"{isa}_linear")


@needs_bf16_kernels
@pytest.mark.parametrize("isa", ["amx", "avx512"])
@pytest.mark.parametrize("features", [600, 576])  # K whole blocks of 32 or not (amx: x read in place, or copied)
def test_a_linear_row_is_the_same_bits_at_any_row_count(isa, features):
    """One row alone, among a decode step's few, in passes of 12 (avx512) or 32 (amx; a last pass of fewer rows
    on tiles of that many), and among a prefill's hundreds; N not a whole number of column blocks."""
    linear = tile_linear_kernel(isa)
    generator = torch.Generator().manual_seed(0)
    out_features = 200
    weight = (torch.randn(out_features, features, generator=generator) / features**0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    x = torch.randn(300, features, generator=generator).to(torch.bfloat16)
    packed = native.tile_pack(weight)
    full = linear(x, packed, bias, out_features)
    for start, rows in [(0, 1), (299, 1), (3, 5), (20, 13), (40, 32), (7, 33), (100, 200)]:
        assert torch.equal(linear(x[start : start + rows], packed, bias, out_features), full[start : start + rows])


@needs_bf16_kernels
@pytest.mark.parametrize("decode_kernel,prefill_kernel", [
    ("paged_decode", "avx512_prefill"),
    pytest.param("amx_decode", "amx_prefill", marks=pytest.mark.skipif(not native.cpu_has_amx(), reason="no AMX")),
])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_a_query_attends_the_same_as_a_decode_and_in_any_chunk(decode_kernel, prefill_kernel, heads, kv_heads,
                                                                head_dim, block_size):
    """Each pair of kernels that runs together (AVX-512's; AMX's where the CPU has it: `native.paged_decode` and
    `native.prefill` pick the pair) gives a query the same bits as a decode and in a chunk, wherever the chunk
    starts (after a prefix-cache hit or a recompute) and ends."""
    kernels = native.load()
    decode, prefill = getattr(kernels, decode_kernel), getattr(kernels, prefill_kernel)
    length, scale = 150, head_dim**-0.5
    k_cache, v_cache, tables = scattered_cache([length], block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    query = torch.randn(length, heads, head_dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = prefill(query, k_cache, v_cache, tables[0], 0, block_size, scale)
    for start, end in [(0, 40), (5, 6), (31, 97), (64, 150), (149, 150)]:
        chunk = prefill(query[start:end], k_cache, v_cache, tables[0], start, block_size, scale)
        assert torch.equal(chunk, whole[start:end]), (start, end)
    positions = [0, 1, 15, 16, 31, 32, 33, 64, 100, 149]  # within, at and past steps of 32 keys
    decodes = decode(query[positions], k_cache, v_cache, tables.expand(len(positions), -1),
                     torch.tensor(positions) + 1, block_size, scale)
    assert torch.equal(decodes, whole[positions])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama whose heads the bf16 kernels take (head_dim 64, three query heads per KV head: SmolLM2's
    shape), with a vocabulary wide enough for near ties."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("invariance") / "llama", hidden_size=384,
                            num_attention_heads=6, num_key_value_heads=2, head_dim=64)


PROMPT_LEN, SHARED_PREFIX, MAX_TOKENS = 45, 32, 12
DTYPES = ["float32", pytest.param("bfloat16", marks=needs_bf16_kernels)]


def record_target(engine):
    """The logits each step gives request "target", recorded as the engine runs."""
    recorded, execute = [], engine.runner.execute

    def recording(plan):
        logits, seqs = execute(plan)
        recorded.extend(row.clone() for row, seq in zip(logits, seqs) if seq.request_id == "target")
        return logits, seqs

    engine.runner.execute = recording
    return recorded


def target_run(model_dir, dtype, target, others=(), prefix_first=None, **knobs):
    """Request `target`'s tokens and logits, run with `others` beside it (after `prefix_first` has filled the
    prefix cache, where given)."""
    engine = engine_for(model_dir, dtype=dtype, **knobs)
    if prefix_first is not None:
        engine.add("first", greedy(prefix_first, 1))
        run_all(engine)
    logits = record_target(engine)
    engine.add("target", greedy(target, MAX_TOKENS))
    for i, prompt in enumerate(others):
        engine.add(f"other{i}", greedy(prompt, MAX_TOKENS + 3 * i))
    finals = run_all(engine)
    if prefix_first is not None:
        assert finals["target"].num_cached_tokens >= SHARED_PREFIX - knobs.get("block_size", 16)
    return finals["target"].token_ids, torch.stack(logits)


def assert_same(run, alone, dtype):
    """The same tokens; in bf16 the same logits too, bit for bit (their rows must not depend on the step)."""
    assert run[0] == alone[0]
    if dtype == "bfloat16":
        assert torch.equal(run[1], alone[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_gets_the_same_tokens_whatever_runs_beside_it(model_dir, dtype):
    """Alone and whole; among 11 others in chunks of a small token budget (its prompt split, some chunks of one
    token, which run as decodes); after another request filled the prefix cache with its first blocks; and with
    prefix caching off among the same others."""
    target, *others = random_prompts(12, seed=3, min_len=PROMPT_LEN, max_len=PROMPT_LEN)
    sharer = target[:SHARED_PREFIX] + others[0][SHARED_PREFIX:]
    alone = target_run(model_dir, dtype, target, max_num_batched_tokens=512)
    assert_same(target_run(model_dir, dtype, target, others, max_num_seqs=12, max_num_batched_tokens=23,
                           block_size=4), alone, dtype)
    assert_same(target_run(model_dir, dtype, target, others[:3], prefix_first=sharer, block_size=4,
                           max_num_batched_tokens=30), alone, dtype)
    assert_same(target_run(model_dir, dtype, target, others, prefix_caching=False, max_num_seqs=12,
                           max_num_batched_tokens=64), alone, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_preempted_request_recomputes_the_same_tokens(model_dir, dtype):
    """A cache too small for every request: some are preempted and recompute their tokens as prompt chunks, keys
    that first came from decodes."""
    target, *others = random_prompts(8, seed=5, min_len=20, max_len=PROMPT_LEN)
    alone = target_run(model_dir, dtype, target)
    engine = engine_for(model_dir, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                        num_blocks=40)
    logits = record_target(engine)
    engine.add("target", greedy(target, MAX_TOKENS))
    for i, prompt in enumerate(others):
        engine.add(f"other{i}", greedy(prompt, 30))
    finals, preempted = run_counting_preemptions(engine)
    assert preempted > 0
    assert_same((finals["target"].token_ids, torch.stack(logits)), alone, dtype)


@needs_bf16_kernels
def test_without_batch_invariance_the_linears_keep_their_fastest_kernels(model_dir):
    """`batch_invariant=False`: oneDNN's packed copy serves many rows, and bf16 is not held to invariance."""
    invariant = engine_for(model_dir, dtype="bfloat16").runner
    fastest = engine_for(model_dir, dtype="bfloat16", batch_invariant=False).runner
    assert invariant.batch_invariant and not fastest.batch_invariant
    q_proj = [runner.model.model.layers[0].self_attn.q_proj for runner in (invariant, fastest)]
    assert q_proj[0].packed_weight is None and q_proj[1].packed_weight is not None
