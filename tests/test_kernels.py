"""The paged attention ops against a plain dense reference, and coexistence with transformers."""


import pytest
import torch

from rqbatcher.kernels.attention import (
    decode_attention,
    gather_blocks,
    length_bias,
    paged_decode_attention,
    prefill_attention,
    shared_prefix_decode_attention,
    write_kv,
)


def dense_reference(q, k, v, q_positions, scaling, window=None):
    """Softmax attention with explicit loops over heads: q [n, H, D], k/v [L, Hkv, D]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scaling
    k_pos = torch.arange(k.shape[0])
    visible = k_pos[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= q_positions[:, None] - k_pos[None, :] < window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("ctx_start,window", [(0, None), (7, None), (7, 5), (0, 4)])
def test_prefill_chunk_matches_dense(ctx_start, window):
    torch.manual_seed(0)
    n, heads, kv_heads, dim = 6, 4, 2, 8
    length = ctx_start + n
    q = torch.randn(n, heads, dim)
    k, v = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    got = prefill_attention(q, k, v, ctx_start, 0.3, window)
    want = dense_reference(q, k, v, torch.arange(ctx_start, length), 0.3, window)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window", [None, 3])
def test_batched_paged_decode_matches_dense(window):
    torch.manual_seed(1)
    heads, kv_heads, dim, block = 4, 1, 8, 4
    k_cache, v_cache = torch.zeros(64, kv_heads, dim), torch.zeros(64, kv_heads, dim)
    lens = [5, 9, 1]
    tables = [[3, 7], [0, 12, 5], [9]]  # scattered blocks
    keys = [torch.randn(n, kv_heads, dim) for n in lens]
    values = [torch.randn(n, kv_heads, dim) for n in lens]
    slots = []
    for table, k, v, n in zip(tables, keys, values, lens):
        s = torch.tensor([table[p // block] * block + p % block for p in range(n)])
        write_kv(k, v, k_cache, v_cache, s)
        slots.append(torch.cat([s, torch.zeros(max(lens) - n, dtype=torch.long)]))
    q = torch.randn(3, heads, dim)
    got = decode_attention(q, k_cache, v_cache, torch.stack(slots), torch.tensor(lens), 0.5, window)
    for i, n in enumerate(lens):
        want = dense_reference(q[i : i + 1], keys[i], values[i], torch.tensor([n - 1]), 0.5, window)
        torch.testing.assert_close(got[i : i + 1], want)


@pytest.mark.parametrize("window", [None, 3])
def test_block_gather_decode_matches_the_reference(window):
    torch.manual_seed(2)
    heads, kv_heads, dim, block = 6, 2, 8, 4
    k_cache, v_cache = torch.randn(80, kv_heads, dim), torch.randn(80, kv_heads, dim)
    lens = torch.tensor([5, 12, 1, 9])
    tables = torch.tensor([[3, 7, 0], [0, 12, 5], [9, 0, 0], [19, 2, 4]])  # scattered, padded with block 0
    positions = torch.arange(int(lens.max()))
    slots = tables[:, positions // block] * block + positions % block
    q = torch.randn(4, heads, dim)
    want = decode_attention(q, k_cache, v_cache, slots, lens, 0.4, window)
    bias = length_bias(lens, tables.shape[1] * block, torch.float32)
    got = paged_decode_attention(q, k_cache, v_cache, tables, bias, block, 0.4, lens, window)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("window", [None, 6, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_decode_matches_the_reference(window, dtype):
    """Decodes starting from the same two blocks (a cached prefix) read them once, each with its own
    blocks beside, and get what each would get alone."""
    torch.manual_seed(3)
    heads, kv_heads, dim, block = 6, 2, 8, 4
    k_cache, v_cache = torch.randn(80, kv_heads, dim), torch.randn(80, kv_heads, dim)
    prefix = [11, 6]
    own = [[3, 7, 0], [12, 0, 0], [19, 2, 4]]  # after the prefix, padded with block 0
    own_lens = [9, 1, 12]
    lens = torch.tensor([8 + n for n in own_lens])
    tables = torch.tensor([prefix + blocks for blocks in own])
    positions = torch.arange(int(lens.max()))
    slots = tables[:, positions // block] * block + positions % block
    q = torch.randn(3, heads, dim)
    want = decode_attention(q, k_cache, v_cache, slots, lens, 0.4, window)
    row = torch.tensor([prefix + [b for blocks in own for b in blocks]])
    bias = torch.full((3, row.shape[1] * block), float("-inf"))
    bias[:, :8] = 0
    for i, n in enumerate(own_lens):
        bias[i, 8 + i * 12 : 8 + i * 12 + n] = 0  # 12 keys per decode after the prefix
    bias = bias.repeat_interleave(heads // kv_heads, dim=0)  # a row per query head
    got = shared_prefix_decode_attention(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), row, bias, block, 0.4,
                                         len(prefix), lens, window)
    assert got.dtype == dtype
    tolerance = {} if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want, **tolerance)


def test_gathering_whole_blocks_equals_indexing_each_slot():
    cache = torch.randn(10 * 4, 2, 8)
    blocks = torch.tensor([7, 2, 9])
    slots = torch.tensor([b * 4 + i for b in blocks.tolist() for i in range(4)])
    assert torch.equal(gather_blocks(cache, blocks, 4), cache[slots])
