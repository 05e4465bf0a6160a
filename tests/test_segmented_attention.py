"""The fused CPU path (`rqbatcher.kernels.segmented`: flash attention over views of the paged cache, merged by
log-sum-exp) against the dense reference, on random shapes and block layouts."""

import random

import pytest
import torch

from rqbatcher.kernels import segmented
from rqbatcher.kernels.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
    attend,
    decode_runs,
    length_bias,
    write_kv,
)
from rqbatcher.kernels.segmented import MAX_VIEW_RUNS, key_rows, key_runs
from tests.test_kernels import dense_reference

CPU = torch.device("cpu")

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def scattered_table(rng: random.Random, num_blocks: int, pool: int, run: int) -> list[int]:
    """`num_blocks` distinct blocks out of `pool`, in runs of up to `run` consecutive blocks."""
    free = list(range(1, pool))
    table: list[int] = []
    while len(table) < num_blocks:
        start = rng.choice(free)
        for block in range(start, start + run):
            if len(table) < num_blocks and block in free:
                table.append(block)
                free.remove(block)
            else:
                break
    return table


def fill(cache_k, cache_v, table, keys, values, block_size):
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(keys.shape[0])])
    write_kv(keys, values, cache_k, cache_v, slots)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_runs_cover_exactly_the_keys_in_order(block_size):
    rng = random.Random(block_size)
    for _ in range(50):
        num_keys = rng.randrange(1, 90)
        table = scattered_table(rng, -(-num_keys // block_size), 200, rng.choice([1, 2, 5, 100]))
        runs = key_runs(table, num_keys, block_size)
        rows = [r for start, n in runs for r in range(start, start + n)]
        assert rows == [table[p // block_size] * block_size + p % block_size for p in range(num_keys)]
        assert all(a + n != b for (a, n), (b, _) in zip(runs, runs[1:])), "adjacent runs must be joined"
        keys = key_rows(table, num_keys, block_size, CPU)
        if len(runs) > MAX_VIEW_RUNS:  # read in one gather of its rows, built once per step
            assert keys.tolist() == rows
        else:
            assert keys == runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3), (4, 1)])
@pytest.mark.parametrize("run", [1, 3, 100])  # blocks per run: scattered (gathered copy), a few runs, one view
def test_decode_over_runs_matches_dense(dtype, heads, kv_heads, run):
    rng = random.Random(heads * 100 + run)
    torch.manual_seed(heads + run)
    dim, block_size, pool = 16, 4, 120
    k_cache = torch.zeros(pool * block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    lens = [1, 5, 17, 40, 3]
    tables, keys, values = [], [], []
    used: set[int] = set()
    for n in lens:
        table = [b for b in scattered_table(rng, 60, pool, run) if b not in used][: -(-n // block_size)]
        used.update(table)
        k, v = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
        fill(k_cache, v_cache, table, k.to(dtype), v.to(dtype), block_size)
        tables.append(table), keys.append(k), values.append(v)
    q = torch.randn(len(lens), heads, dim)
    runs = [key_rows(t, n, block_size, CPU) for t, n in zip(tables, lens)]
    got = segmented.decode(q.to(dtype), k_cache, v_cache, runs, 0.3)
    assert got.dtype == dtype and got.shape == q.shape
    for i, n in enumerate(lens):
        want = dense_reference(q[i : i + 1], keys[i].to(dtype).float(), values[i].to(dtype).float(),
                               torch.tensor([n - 1]), 0.3)
        torch.testing.assert_close(got[i : i + 1].float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (4, 1)])
@pytest.mark.parametrize("ctx_start,n,block_size,run", [(8, 5, 4, 100), (13, 9, 4, 2), (30, 1, 4, 1), (7, 20, 1, 3),
                                                        (64, 32, 16, 1), (5, 40, 16, 100)])
def test_chunk_after_cached_keys_matches_dense(dtype, heads, kv_heads, ctx_start, n, block_size, run):
    """A chunk at positions [ctx_start, ctx_start + n) of a sequence whose earlier keys are cached in
    scattered blocks (a prefix-cache hit, or the chunks before it)."""
    rng = random.Random(ctx_start * 7 + n)
    torch.manual_seed(ctx_start + n)
    dim, pool = 8, 200
    length = ctx_start + n
    table = scattered_table(rng, -(-length // block_size), pool, run)
    keys, values = torch.randn(length, kv_heads, dim).to(dtype), torch.randn(length, kv_heads, dim).to(dtype)
    k_cache = torch.zeros(pool * block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    fill(k_cache, v_cache, table, keys, values, block_size)
    q = torch.randn(n, heads, dim).to(dtype)
    got = segmented.prefill(q, keys[ctx_start:], values[ctx_start:], k_cache, v_cache,
                            key_rows(table, ctx_start, block_size, CPU), 0.4)
    want = dense_reference(q.float(), keys.float(), values.float(), torch.arange(ctx_start, length), 0.4)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


def test_merging_parts_equals_one_softmax_over_their_keys():
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    whole, _ = segmented._flash(q, k, v, 0.0, False, scale=0.5)
    for cuts in ([10], [4, 11], [1, 2, 29]):
        bounds = [0, *cuts, 30]
        parts = [segmented._flash(q, k[:, :, a:b], v[:, :, a:b], 0.0, False, scale=0.5)
                 for a, b in zip(bounds, bounds[1:])]
        torch.testing.assert_close(segmented.merge(parts, torch.float32), whole)


def test_attend_takes_the_fused_path_only_where_it_is_given_runs(monkeypatch):
    """One step with decodes at long and short contexts and a chunk after cached keys: the fused path and the
    padded reference give the same output, and the layer's new keys are written either way."""
    torch.manual_seed(7)
    heads, kv_heads, dim, block_size, pool = 6, 2, 8, 4, 600
    rng = random.Random(7)
    caches = [(torch.randn(pool * block_size, kv_heads, dim), torch.randn(pool * block_size, kv_heads, dim))]
    lens = [300, 41, 2]  # decodes' contexts, their new key included
    used: set[int] = set()
    tables = []
    for n in lens + [30]:
        table = [b for b in scattered_table(rng, 200, pool, 5) if b not in used][: -(-n // block_size)]
        used.update(table)
        tables.append(table)
    ctx_start, chunk = 22, 8  # the chunk: keys 22..29 of the last table
    slots = [tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    slots += [tables[3][p // block_size] * block_size + p % block_size for p in range(ctx_start, ctx_start + chunk)]
    num = len(slots)
    q, k, v = torch.randn(num, heads, dim), torch.randn(num, kv_heads, dim), torch.randn(num, kv_heads, dim)

    def metadata(fused: bool) -> AttentionMetadata:
        groups = []
        for i, n in enumerate(lens):
            width = len(tables[i])
            runs = decode_runs([tables[i]], [n], block_size, torch.device("cpu")) if fused else None
            groups.append(DecodeGroup(i, i + 1, torch.tensor([tables[i]]), torch.tensor([n]),
                                      length_bias(torch.tensor([n]), width * block_size, torch.float32), runs=runs))
        span = PrefillSpan.of(len(lens), chunk, ctx_start, tables[3], block_size, torch.device("cpu"))
        if not fused:
            span.context_runs = None
        return AttentionMetadata([tuple(c.clone() for c in caches[0])], num, torch.tensor(slots), len(lens),
                                 block_size, groups, [span])

    fused, reference = metadata(True), metadata(False)
    assert fused.decode_groups[0].runs is not None and fused.decode_groups[2].runs is None  # 300 keys; 2 keys
    calls = []
    monkeypatch.setattr(segmented, "prefill", lambda *a, **kw: calls.append(1) or PREFILL(*a, **kw))
    got = attend(q, k, v, fused, 0, 0.35, None)
    assert calls, "the chunk after cached keys did not take the fused path"
    want = attend(q, k, v, reference, 0, 0.35, None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(fused.kv_caches[0][0], reference.kv_caches[0][0])


PREFILL = segmented.prefill


def test_other_devices_keep_the_reference_path():
    meta = torch.device("meta")
    assert decode_runs([[1, 2, 3]], [600], 4, meta) is None
    assert PrefillSpan.of(0, 4, 8, [1, 2, 3], 4, meta).context_runs is None
    assert PrefillSpan.of(0, 4, 0, [1], 4, torch.device("cpu")).context_blocks is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_run", [1, 100])  # the shared prefix in scattered blocks, or one view
def test_decodes_sharing_a_prefix_match_dense(dtype, prefix_run):
    """Decodes that start from the same cached blocks read them in one call, each with its own blocks beside."""
    rng = random.Random(prefix_run)
    torch.manual_seed(11)
    heads, kv_heads, dim, block_size, pool = 6, 2, 8, 4, 300
    prefix = scattered_table(rng, 7, pool, prefix_run)  # 28 shared keys
    own_lens = [1, 9, 4]
    own = [[b for b in scattered_table(rng, 3, pool, 2) if b not in prefix][: -(-n // block_size)] for n in own_lens]
    k_cache = torch.randn(pool * block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(pool * block_size, kv_heads, dim).to(dtype)
    width = max(map(len, own))
    own_blocks = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in own])
    own_bias = length_bias(torch.tensor(own_lens), width * block_size, dtype)
    q = torch.randn(len(own_lens), heads, dim).to(dtype)
    prefix_keys = key_rows(prefix, 28, block_size, CPU)
    got = segmented.shared_prefix_decode(q, k_cache, v_cache, prefix_keys, own_blocks, own_bias, block_size, 0.3)
    assert got.dtype == dtype
    for i, n in enumerate(own_lens):
        table = prefix + own[i]
        rows = [table[p // block_size] * block_size + p % block_size for p in range(28 + n)]
        want = dense_reference(q[i : i + 1].float(), k_cache[rows].float(), v_cache[rows].float(),
                               torch.tensor([28 + n - 1]), 0.3)
        torch.testing.assert_close(got[i : i + 1].float(), want, **TOLERANCE[dtype])
