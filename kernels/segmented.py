"""Attention over contiguous ranges of the paged KV cache, merged by log-sum-exp: the CPU's fused path.

A sequence's keys sit in KV blocks, and consecutive blocks are one contiguous range of cache rows (a *run*),
which attention reads as a view: no copy, no mask. Attending to each run on its own and merging the results
by their log-sum-exp gives the softmax over all of them, as flash attention does inside itself. So:

- a decode attends to the runs of its blocks (its query heads of a KV head folded into one query row each);
- a prefill chunk after cached context attends to the context's runs (every cached key precedes the chunk,
  so no mask) and, causally, to its own fresh keys; then the two merge.

PyTorch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) runs each part and returns the
log-sum-exp; with an explicit mask SDPA leaves that path. A table split into more than MAX_VIEW_RUNS runs is
gathered into one copy instead: past a few runs, the calls and the merge cost more than the copy saves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Run = tuple[int, int]  # (first cache row, number of keys)
Keys = list[Run] | torch.Tensor  # a sequence's keys: runs of cache rows (read as views), or its rows (one gather)

MAX_VIEW_RUNS = 4  # more runs than this: gather the blocks into one copy, one call
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def key_runs(block_table: Sequence[int], num_keys: int, block_size: int) -> list[Run]:
    """The cache rows of a sequence's first `num_keys` keys, as runs of consecutive rows."""
    runs: list[Run] = []
    start, length, previous = -1, 0, -2
    for i in range((num_keys + block_size - 1) // block_size):
        block = block_table[i]
        if block != previous + 1:
            if length:
                runs.append((start, length))
            start, length = block * block_size, 0
        length += min(block_size, num_keys - i * block_size)
        previous = block
    if length:
        runs.append((start, length))
    return runs


def key_rows(block_table: Sequence[int], num_keys: int, block_size: int, device: torch.device) -> Keys:
    """A sequence's first `num_keys` keys as the fused path reads them, built once per step: its runs, or,
    split into more than MAX_VIEW_RUNS runs, the tensor of its cache rows."""
    runs = key_runs(block_table, num_keys, block_size)
    if len(runs) <= MAX_VIEW_RUNS:
        return runs
    return torch.tensor([r for start, n in runs for r in range(start, start + n)], device=device)


def _rows(cache: torch.Tensor, keys: Keys) -> list[torch.Tensor]:
    """The keys (or values) `keys` as `[1, Hkv, L, D]` tensors, from `cache [1, Hkv, slots, D]` (the cache seen
    head-major): views of it, or one gathered copy."""
    if isinstance(keys, torch.Tensor):
        return [cache.index_select(2, keys)]
    return [cache.narrow(2, s, n) for s, n in keys]


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache `[slots, Hkv, D]` as the flash kernel reads keys, `[1, Hkv, slots, D]` (a view)."""
    return cache.transpose(0, 1).unsqueeze(0)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Combine attention outputs `[..., D]` over disjoint key sets, each with its log-sum-exp `[...]` (fp32),
    into the output over all their keys."""
    if len(parts) == 1:
        return parts[0][0].to(dtype)
    if len(parts) == 2:
        (first, lse_first), (second, lse_second) = parts
        weight = torch.sigmoid(lse_first - lse_second).unsqueeze(-1)  # the first part's share of the softmax
        return torch.lerp(second.float(), first.float(), weight).to(dtype)
    total = torch.stack([lse for _, lse in parts]).logsumexp(0)
    out = sum(o.float() * (lse - total).exp().unsqueeze(-1) for o, lse in parts)
    return out.to(dtype)


def decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: list[Keys],
           scaling: float) -> torch.Tensor:
    """One query per sequence, `query [B, H, D]`, each over the keys of its `runs`; returns `[B, H, D]`.
    A sequence's query heads that share a KV head are its query rows there, so keys are read once."""
    batch, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    keys, values = head_major(k_cache), head_major(v_cache)
    outs = []
    for q, seq_runs in zip(query.view(batch, 1, kv_heads, heads // kv_heads, dim).unbind(0), runs):
        parts = [_flash(q, k, v, 0.0, False, scale=scaling)
                 for k, v in zip(_rows(keys, seq_runs), _rows(values, seq_runs))]
        outs.append(parts[0][0] if len(parts) == 1 else merge(parts, query.dtype))
    return torch.cat(outs).view(batch, heads, dim)


def shared_prefix_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         prefix_runs: Keys, own_blocks: torch.Tensor, own_bias: torch.Tensor, block_size: int,
                         scaling: float) -> torch.Tensor:
    """Decodes `query [B, H, D]` that all start from the same cached keys (`prefix_runs`), each followed by its
    own blocks (`own_blocks [B, W]`, padded; `own_bias [B, W * block_size]` hides the padding). Every decode's
    queries of a KV head meet the prefix in one call, reading it once and with no mask; each decode's own keys
    come in one padded call; the two merge."""
    batch, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    q = query.view(batch, kv_heads, group, dim)
    folded = q.transpose(0, 1).reshape(1, kv_heads, batch * group, dim)
    prefix = [_flash(folded, k, v, 0.0, False, scale=scaling)
              for k, v in zip(_rows(head_major(k_cache), prefix_runs), _rows(head_major(v_cache), prefix_runs))]
    lse = prefix[0][1] if len(prefix) == 1 else torch.stack([lse for _, lse in prefix]).logsumexp(0)
    out = merge(prefix, query.dtype)
    parts = [(out[0].view(kv_heads, batch, group, dim).transpose(0, 1),
              lse[0].view(kv_heads, batch, group).transpose(0, 1))]
    flat = own_blocks.reshape(-1)
    own_keys = k_cache.view(-1, block_size, kv_heads, dim).index_select(0, flat).view(batch, -1, kv_heads, dim)
    own_values = v_cache.view(-1, block_size, kv_heads, dim).index_select(0, flat).view(batch, -1, kv_heads, dim)
    parts.append(_flash(q, own_keys.transpose(1, 2), own_values.transpose(1, 2), 0.0, False,
                        attn_mask=own_bias[:, None, None, :].to(query.dtype), scale=scaling))
    return merge(parts, query.dtype).reshape(batch, heads, dim)


def prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, context_runs: Keys, scaling: float) -> torch.Tensor:
    """A prompt chunk `query [n, H, D]` with its own keys and values `[n, Hkv, D]`, after the cached keys of
    `context_runs` (all of which precede it): causal over the chunk, full over the context."""
    n, heads, dim = query.shape
    q = query.transpose(0, 1).unsqueeze(0)
    out, lse = _flash(q, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0), 0.0, True,
                      scale=scaling)
    parts = [(out[0].transpose(0, 1), lse[0].transpose(0, 1))]
    for k, v in zip(_rows(head_major(k_cache), context_runs), _rows(head_major(v_cache), context_runs)):
        out, lse = _flash(q, k, v, 0.0, False, scale=scaling)
        parts.append((out[0].transpose(0, 1), lse[0].transpose(0, 1)))
    return merge(parts, query.dtype)
