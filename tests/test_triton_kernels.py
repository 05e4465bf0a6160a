"""The Triton attention backend against the torch reference, on CPU in triton's interpreter (TRITON_INTERPRET=1,
set in tests/conftest.py), or on CUDA where `make gpu-check` runs these tests.

A random step mixes decodes and prefill chunks, some after cached context, one starting from blocks that
another sequence of the same step fills (a prefix-cache hit), over scattered blocks; the kernels must store
the same cache and attend as `rqbatcher.kernels.attention` does. The interpreter is slow: the default cases cover each
GQA ratio, block size, window and dtype once; the full product is `slow`.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET", "0") == "0" and torch.cuda.is_available()
                      else "cpu")
pytest.importorskip("triton", minversion="3.9" if DEVICE.type == "cpu" else None)  # older interpreters lack bf16

from rqbatcher.config import EngineConfig  # noqa: E402
from rqbatcher.kernels.attention import gather_blocks, prefill_attention, write_kv  # noqa: E402
from rqbatcher.kernels.triton_attention import FlatAttentionMetadata  # noqa: E402
from rqbatcher.workers.model.attention_backend import AttentionBackendError, resolve_attention_backend  # noqa: E402
from tests.engine_helpers import engine_for, greedy, random_prompts, reference_tokens, run_all  # noqa: E402

pytestmark = pytest.mark.triton
KV_HEADS = 2
HEAD_DIM = 16
SCALING = 0.3
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 5e-3, "rtol": 5e-3},
             torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
# (cached context before the chunk, new tokens) of each sequence: decodes first, then prefill chunks.
MIXED_STEP = [(6, 1), (37, 1), (0, 1), (0, 9), (13, 5), (0, 21), (8, 7)]


def random_step(spec, gqa, block_size, dtype, seed, shared_prefix=True):
    """A step over `spec` with scattered blocks and a random cache. With `shared_prefix`, the last sequence
    also starts from the first blocks of the fourth (a prefix-cache hit on blocks written this very step)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(start + n) // block_size) for start, n in spec]
    num_blocks = sum(needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(count)] for count in needed]
    if shared_prefix:
        donor, reader = 3, len(spec) - 1
        shared = min(len(tables[donor]), spec[reader][0] // block_size)
        tables[reader][:shared] = tables[donor][:shared]
    slots = [table[p // block_size] * block_size + p % block_size
             for table, (start, n) in zip(tables, spec) for p in range(start, start + n)]
    tokens = len(slots)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    caches = (rand(num_blocks * block_size, KV_HEADS, HEAD_DIM), rand(num_blocks * block_size, KV_HEADS, HEAD_DIM))
    q = rand(tokens, KV_HEADS * gqa, HEAD_DIM)
    # new keys as the model hands them: a transposed view of [Hkv, T, D]
    k = rand(KV_HEADS, tokens, HEAD_DIM).transpose(0, 1)
    v = rand(KV_HEADS, tokens, HEAD_DIM).transpose(0, 1)
    rows = [(table, start, n) for table, (start, n) in zip(tables, spec)]
    return rows, slots, caches, q, k, v


def torch_reference(rows, slots, caches, q, k, v, block_size, window):
    """The torch path: write every new key first, then attend each sequence over its gathered context."""
    k_cache, v_cache = (c.clone() for c in caches)
    write_kv(k, v, k_cache, v_cache, torch.tensor(slots))
    out, row = [], 0
    for table, start, n in rows:
        length = start + n
        ctx_k = gather_blocks(k_cache, torch.tensor(table), block_size)[:length].float()
        ctx_v = gather_blocks(v_cache, torch.tensor(table), block_size)[:length].float()
        out.append(prefill_attention(q[row : row + n].float(), ctx_k, ctx_v, start, SCALING, window))
        row += n
    return torch.cat(out), k_cache, v_cache


def triton_step(rows, slots, caches, q, k, v, block_size, window, padding=0):
    k_cache, v_cache = (c.clone().to(DEVICE) for c in caches)
    md = FlatAttentionMetadata.build([(k_cache, v_cache)], block_size, rows, slots, DEVICE)

    def pad(t):
        return torch.cat([t, torch.ones(padding, *t.shape[1:], dtype=t.dtype)])

    out = md.attend(pad(q).to(DEVICE), pad(k).to(DEVICE), pad(v).to(DEVICE), 0, SCALING, window)
    return out.cpu(), k_cache.cpu(), v_cache.cpu()


def check_step(gqa, block_size, window, dtype, spec=MIXED_STEP, seed=0):
    rows, slots, caches, q, k, v = random_step(spec, gqa, block_size, dtype, seed)
    want, want_k, want_v = torch_reference(rows, slots, caches, q, k, v, block_size, window)
    got, got_k, got_v = triton_step(rows, slots, caches, q, k, v, block_size, window)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("gqa,block_size,window,dtype", [
    (1, 16, None, torch.float32),
    (2, 1, None, torch.float32),
    (4, 32, 7, torch.float32),
    (8, 16, None, torch.bfloat16),
    (2, 32, 16, torch.float16),
    (3, 16, 12, torch.bfloat16),  # SmolLM2's ratio: not a power of two
])
def test_a_mixed_step_matches_the_torch_path(gqa, block_size, window, dtype):
    check_step(gqa, block_size, window, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("gqa,block_size,window,dtype",
                         list(itertools.product([1, 2, 4, 8], [1, 16, 32], [None, 5, 16],
                                                [torch.float32, torch.bfloat16])))
def test_every_shape_matches_the_torch_path(gqa, block_size, window, dtype):
    check_step(gqa, block_size, window, dtype, seed=gqa * 100 + block_size)


@pytest.mark.parametrize("window", [None, 50])
def test_long_contexts_split_across_programs_merge_to_the_same_output(window):
    """Several programs share each query tile's keys (split-KV), and their log-sum-exp merge is exact."""
    from rqbatcher.kernels import triton_kernels

    spec = [(150, 1), (0, 1), (90, 1), (40, 6)]
    rows, slots, caches, q, k, v = random_step(spec, 2, 16, torch.float32, seed=5, shared_prefix=False)
    want, _, _ = torch_reference(rows, slots, caches, q, k, v, 16, window)
    k_cache, v_cache, q, k, v = (t.to(DEVICE) for t in (*caches, q, k, v))
    md = FlatAttentionMetadata.build([(k_cache, v_cache)], 16, rows, slots, DEVICE)
    triton_kernels.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        triton_kernels.paged_attention(q, k_cache, v_cache, out, md.block_tables, md.query_start, md.seq_lens,
                                       md.num_tokens, md.max_query_len, 16, SCALING, window, splits, kv_tile=16,
                                       block_m=16)
        torch.testing.assert_close(out.cpu(), want, **TOLERANCE[torch.float32])


def test_split_count_fills_the_device_only_for_long_contexts():
    from rqbatcher.kernels.triton_kernels import splits_for

    assert splits_for(programs=4, max_seq_len=8192, target_programs=256, min_keys_per_split=256, max_splits=16) == 16
    assert splits_for(programs=4, max_seq_len=600, target_programs=256, min_keys_per_split=256, max_splits=16) == 2
    assert splits_for(programs=512, max_seq_len=8192, target_programs=256, min_keys_per_split=256, max_splits=16) == 1
    assert splits_for(programs=4, max_seq_len=100, target_programs=256, min_keys_per_split=256, max_splits=16) == 1


def test_padding_rows_of_a_compiled_step_get_zeros_and_write_nothing():
    spec = [(5, 1), (0, 4)]
    rows, slots, caches, q, k, v = random_step(spec, 2, 4, torch.float32, seed=3, shared_prefix=False)
    want, want_k, want_v = torch_reference(rows, slots, caches, q, k, v, 4, None)
    got, got_k, got_v = triton_step(rows, slots, caches, q, k, v, 4, None, padding=3)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    torch.testing.assert_close(got[: len(slots)], want)
    assert not got[len(slots) :].any()


def test_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    no_cpu_kernel = "they run in bfloat16, not float32"
    assert resolve_attention_backend("auto", cpu, no_cpu_kernel) == "torch"
    assert resolve_attention_backend("auto", cpu, None) == "cpu"
    assert resolve_attention_backend("torch", cpu, None) == "torch"
    assert resolve_attention_backend("cpu", cpu, None) == "cpu"
    with pytest.raises(AttentionBackendError, match="cpu cannot run here: they run in bfloat16"):
        resolve_attention_backend("cpu", cpu, no_cpu_kernel)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", cpu, None) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(AttentionBackendError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", cpu, None)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, triton, cpu"):
        EngineConfig(attention_backend="flash")


@pytest.mark.parametrize("family", ["llama", "mistral"])  # GQA 2; and a sliding window of 24 (prompts reach 40)
def test_greedy_tokens_equal_generate_with_the_triton_backend(tiny_model_dir, family):
    model_dir = tiny_model_dir(family)
    engine = engine_for(model_dir, dtype="float32", attention_backend="triton", device=str(DEVICE), max_num_seqs=4,
                        max_num_batched_tokens=16, block_size=4)
    assert engine.runner.flat_attention
    prompts = random_prompts(4, seed=7, min_len=10, max_len=40)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, 5))
    finals = run_all(engine)
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == reference_tokens(model_dir, prompt, 5), f"request r{i} diverged"


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [{"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 16},
                                   {"max_num_seqs": 6, "max_num_batched_tokens": 5, "block_size": 1},
                                   {"max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 4,
                                    "num_blocks": 24}])
def test_greedy_tokens_equal_generate_for_every_family(tiny_model_dir, family, knobs):
    model_dir = tiny_model_dir(family)
    engine = engine_for(model_dir, dtype="float32", attention_backend="triton", device=str(DEVICE), **knobs)
    prompts = random_prompts(8, seed=11, max_len=40)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, 12))
    finals = run_all(engine)
    for i, prompt in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == reference_tokens(model_dir, prompt, 12), f"request r{i} diverged"


def generate_on(model_dir, prompts, max_tokens, device) -> list[list[int]]:
    """`model.generate` on each prompt alone, greedy and in fp32, on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "smollm2"])
def test_greedy_tokens_equal_generate_on_the_gpu_check_models(name, tmp_path):
    """What `make gpu-check` asks of a GPU: SmolLM2 (GQA 3) and a tiny Qwen3 (q/k norms), long prompts in chunks."""
    from rqbatcher.workers.model.loading import smollm2_checkpoint
    from tests.tiny_models import build_tiny_model

    if name == "smollm2" and DEVICE.type == "cpu":
        pytest.skip("SmolLM2 in triton's interpreter takes too long: make gpu-check runs it on CUDA")
    model_dir = smollm2_checkpoint() if name == "smollm2" else build_tiny_model(name, tmp_path)
    engine = engine_for(model_dir, dtype="float32", attention_backend="triton", device=str(DEVICE), max_num_seqs=8,
                        max_num_batched_tokens=64, block_size=16)
    prompts = random_prompts(6, seed=13, min_len=5, max_len=150, vocab=engine.loaded.vocab_size)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", greedy(prompt, 16))
    finals = run_all(engine)
    want = generate_on(model_dir, prompts, 16, DEVICE)
    for i in range(len(prompts)):
        assert finals[f"r{i}"].token_ids == want[i], f"request r{i} diverged"
