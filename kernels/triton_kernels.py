"""Triton kernels of the paged KV cache: store a step's new keys and values, and attend for the whole step.

This module imports triton, so only `rqbatcher.kernels.triton_attention` imports it, on first use: `import kernels`
and the torch path never need triton. On CPU tensors the kernels run under `TRITON_INTERPRET=1` (the
tests), which must be set before this module is first imported: `@triton.jit` reads it.

The attention kernel is one launch per layer per step, for every decode and prefill chunk of the step:
- Queries are varlen: sequence i owns rows `[query_start[i], query_start[i + 1])`, the last of its
  `seq_lens[i]` cache positions (so a chunk after cached context, prefix-cache hits included, attends to
  everything before it, and causally within itself).
- A program takes a tile of `block_q` query tokens of one sequence times the `gqa` query heads of one KV
  head (`block_m = block_q * gqa` rows padded to a power of two): each key tile is loaded once for all
  the query heads that share it. Programs map to (sequence, query tile) by a binary search over
  `query_start[i] // block_q + i`, a start that leaves every sequence room for its tiles, so the grid is
  sized from the token and sequence counts alone (no host-side tile list).
- Keys are read in tiles of `kv_tile` positions through the block table, whatever the cache's block size.
- Long contexts are split over `num_splits` programs per query tile; each writes its partial output and
  log-sum-exp, and a second kernel merges them. With one split the first kernel writes the output.
- Scores are in base 2 (`exp2`, the scaling premultiplied by log2 e), accumulated in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every dimension of at least 16
# fp32 models multiply in full fp32 (tf32 would break greedy equality with `generate`); fp16/bf16 ignore it.
DOT_PRECISION = {True: "ieee", False: "tf32"}


@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slot_mapping, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cache_slot, stride_cache_head, num_kv_heads,
                     HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    """One program per new token: copy its keys and values `[kv_heads, head_dim]` to its cache slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    to = slot * stride_cache_slot + heads * stride_cache_head + dims
    k = tl.load(key + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache + to, k, mask=mask)
    v = tl.load(value + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache + to, v, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`rqbatcher.kernels.attention.write_kv` as one launch: `key/value [T, kv_heads, head_dim]` (any strides with a
    contiguous last dimension) to their slots of `k_cache/v_cache [slots, kv_heads, head_dim]`."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _dense_last_dim(key.to(k_cache.dtype)), _dense_last_dim(value.to(v_cache.dtype))
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), kv_heads,
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(kv_heads), DIM_PAD=triton.next_power_of_2(head_dim))


@triton.jit
def _find_sequence(query_start, num_seqs, program, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query-tile program is at most `program` (a binary search)."""
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        first = tl.load(query_start + mid) // BLOCK_Q + mid
        if first <= program:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _paged_attention_kernel(
        out, part_out, part_lse, query, k_cache, v_cache, block_tables, query_start, seq_lens,
        scale_log2, num_seqs, num_heads, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cache_slot, stride_cache_head, stride_table,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, GQA: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, KV_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SLIDING: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(query_start, num_seqs, program, BLOCK_Q)
    q_begin = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_begin
    q_tile = program - (q_begin // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    first_pos = tl.load(seq_lens + seq) - q_len  # cache position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GQA
    head = kv_head * GQA + rows % GQA
    row_ok = (rows < BLOCK_Q * GQA) & (token < q_len)
    q_pos = first_pos + token
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_begin + token).to(tl.int64)
    q = tl.load(query + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # The keys this query tile may see, in key tiles, and this split's share of them.
    kv_end = first_pos + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_begin = 0
    if SLIDING:
        kv_begin = tl.maximum(0, first_pos + q_tile * BLOCK_Q - window + 1)
    tile_low = kv_begin // KV_TILE
    tile_high = tl.cdiv(kv_end, KV_TILE)
    per_split = tl.cdiv(tile_high - tile_low, NUM_SPLITS)
    split_low = tile_low + split * per_split
    split_high = tl.minimum(split_low + per_split, tile_high)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    for tile in range(split_low, split_high):
        keys = tile * KV_TILE + tl.arange(0, KV_TILE)
        key_ok = keys < kv_end
        blocks = tl.load(block_tables + seq * stride_table + keys // BLOCK_SIZE, mask=key_ok, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        at = slots * stride_cache_slot + kv_head * stride_cache_head
        k = tl.load(k_cache + at[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(v_cache + at[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (q_pos[:, None] - keys[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet stays at zero
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        p = p.to(v.dtype)
        if DOT_IN_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new

    result = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 result.to(out.dtype.element_ty), mask=store_mask)
    else:
        part = (q_rows * num_heads + head) * NUM_SPLITS + split
        tl.store(part_out + part[:, None] * HEAD_DIM + dims[None, :], result, mask=store_mask)
        tl.store(part_lse + part, tl.where(l > 0.0, m + tl.log2(tl.maximum(l, 1e-30)), float("-inf")), mask=row_ok)


@triton.jit
def _merge_splits_kernel(out, part_out, part_lse, num_heads, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    """One program per (token, head): weigh each split's output by its share of the softmax mass."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    part = (token * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse + part, mask=splits < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out + part[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits[:, None] < NUM_SPLITS) & (dims[None, :] < HEAD_DIM), other=0.0)
    result = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out + token * stride_ot + head * stride_oh + dims, result.to(out.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                    num_tokens: int, max_query_len: int, block_size: int, scaling: float,
                    sliding_window: int | None, num_splits: int, kv_tile: int, block_m: int) -> None:
    """Attention of the step's queries `query [>= num_tokens, H, D]` into `out` (same shape), one launch
    (two with `num_splits > 1`). The launch shapes (`num_splits`, `kv_tile`, `block_m`) are the caller's
    choice: `rqbatcher.kernels.triton_attention` picks them."""
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    _, heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    gqa = heads // kv_heads
    block_m = max(block_m, triton.next_power_of_2(gqa))
    block_q = min(block_m // gqa, triton.next_power_of_2(max_query_len))
    block_m = max(MIN_DOT, triton.next_power_of_2(block_q * gqa))
    dim_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    query = _dense_last_dim(query)
    part_out = part_lse = out
    if num_splits > 1:
        part_out = torch.empty(num_tokens * heads * num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_tokens * heads * num_splits, dtype=torch.float32, device=query.device)
    grid = (num_tokens // block_q + num_seqs, kv_heads, num_splits)
    on_cpu = query.device.type == "cpu"  # the interpreter: its dot mishandles bf16, so dots run on fp32 copies
    _paged_attention_kernel[grid](
        out, part_out, part_lse, query, k_cache, v_cache, block_tables, query_start, seq_lens,
        scaling * LOG2_E, num_seqs, heads, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, GQA=gqa, BLOCK_Q=block_q, BLOCK_M=block_m, KV_TILE=kv_tile,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, SLIDING=sliding_window is not None,
        DOT_IN_FP32=on_cpu, DOT_PRECISION=DOT_PRECISION[query.dtype == torch.float32])
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, heads)](
            out, part_out, part_lse, heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits))


def _dense_last_dim(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its last dimension is contiguous (the kernels take the other strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def splits_for(programs: int, max_seq_len: int, target_programs: int, min_keys_per_split: int,
               max_splits: int) -> int:
    """How many programs share each query tile's keys: enough to give the device `target_programs`
    programs, no more than `max_splits`, and never so many that a split has fewer than `min_keys_per_split`."""
    wanted = math.ceil(target_programs / max(1, programs))
    return max(1, min(wanted, max_splits, max_seq_len // min_keys_per_split))
