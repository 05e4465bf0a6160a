"""Paged attention over a ragged batch, in torch (runs anywhere, used on CPU).

A step's new tokens of all sequences are concatenated into one row. Decode tokens (one query
per sequence) come first, then prefill chunks. Keys and values live in a paged cache per layer,
`[num_blocks * block_size, kv_heads, head_dim]`, addressed by slot numbers.

`paged_attention` has the signature of a transformers attention function; the model loader registers
it. The runner builds the step's `AttentionMetadata` once and runs the forward inside
`step_metadata(...)`, where every layer reads it. Inside a compiled forward each layer's attention is
the op `batcher::paged_attention`, which the compiler treats as opaque.

Each layer writes the new keys and values of *all* sequences before any of them attends: with prefix
caching, a sequence may start from blocks that another sequence fills in the same step.

On a CPU, decodes at long contexts and prompt chunks after cached keys take the fused path of
`rqbatcher.kernels.segmented` (flash attention over views of the cache, merged by log-sum-exp) when the runner gives
their keys as runs of cache rows (`decode_runs`, `context_runs`). On the cpu backend the decodes take the bf16
kernel of `rqbatcher.kernels.native` instead, and in bf16 so do prompt chunks (`native.prefill`: the chunk over all its
keys, cached and its own, straight from the paged cache), and a query gets the same bits from both
(docs/batch-invariance.md). The padded, masked paths below are the
reference, and serve sliding windows, short contexts and other devices.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rqbatcher.kernels import native, segmented
from rqbatcher.kernels.segmented import Keys, key_rows

ATTENTION_NAME = "batcher_paged"
SEGMENTED_DECODE_MIN_KEYS = 160  # below this mean context, one padded call for a group beats a call per decode


@dataclass
class PrefillSpan:
    """One sequence's prompt chunk: rows `[q_start, q_start + q_len)` of the batch, at cache
    positions `[ctx_start, ctx_start + q_len)`. `context_blocks` lists the KV blocks of all its keys so
    far, or is None when the chunk is the whole context (first chunk: attend to the fresh keys)."""

    q_start: int
    q_len: int
    ctx_start: int
    context_blocks: torch.Tensor | None
    context_runs: Keys | None = None  # the cache rows of the `ctx_start` keys before the chunk (fused path)
    native: bool = False  # read by `rqbatcher.kernels.native.prefill` (the cpu backend in bf16), `context_blocks` set

    @classmethod
    def of(cls, q_start: int, q_len: int, ctx_start: int, block_table: list[int], block_size: int,
           device: torch.device, native: bool = False) -> PrefillSpan:
        """The span of a chunk at cache positions `[ctx_start, ctx_start + q_len)` of a sequence's blocks."""
        if ctx_start == 0 and not native:
            return cls(q_start, q_len, 0, None)
        blocks = torch.tensor(block_table[: -(-(ctx_start + q_len) // block_size)], device=device)
        if native:
            return cls(q_start, q_len, ctx_start, blocks, native=True)
        runs = key_rows(block_table, ctx_start, block_size, device) if device.type == "cpu" else None
        return cls(q_start, q_len, ctx_start, blocks, runs)


@dataclass
class DecodeGroup:
    """Decodes of similar context length, rows `[start, end)` of the batch. Their keys are padded
    to the group's longest context, so one long sequence does not pad every other one.

    With `shared_blocks`, every decode of the group starts from the same KV blocks (a prefix from the
    prefix cache): `block_tables` is then one row, those blocks once and then each decode's own blocks,
    and `bias` says which of those keys each decode sees."""

    start: int
    end: int
    block_tables: torch.Tensor  # [b, W] KV blocks, padded with block 0 (shared: [1, W])
    context_lens: torch.Tensor  # [b]
    bias: torch.Tensor | None  # [b, W * block_size] 0 for the keys a decode sees, -inf for padding (shared: see
    # below); None for `native`, built where a sliding window takes the group to the padded path
    shared_blocks: int = 0  # how many blocks of the single row all decodes share
    runs: list[Keys] | None = None  # each decode's keys as runs of cache rows: the fused path (`decode_runs`)
    prefix_runs: Keys | None = None  # shared: the prefix's keys as runs of cache rows (`shared_prefix_runs`)
    native: bool = False  # read by `rqbatcher.kernels.native`'s bf16 decode kernel (the cpu backend)


@dataclass
class AttentionMetadata:
    """One step's addressing, built once per step by the runner and shared by every layer."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    num_tokens: int  # the step's real tokens; a compiled forward may run on more rows (padding)
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of every new token
    num_decodes: int  # the first rows: one query token per sequence
    block_size: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]

    @classmethod
    def idle(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
             device: torch.device) -> AttentionMetadata:
        """A step with no real token (every row is padding): what compiling a graph runs."""
        return cls(kv_caches, 0, torch.empty(0, dtype=torch.long, device=device), 0, block_size, [], [])


def decode_runs(block_tables: list[list[int]], context_lens: list[int], block_size: int,
                device: torch.device) -> list[Keys] | None:
    """Each decode's keys as runs of cache rows, for the fused path; None where the padded call is faster
    (short contexts: a call per decode costs more than the padding) or the fused path does not run."""
    if device.type != "cpu" or sum(context_lens) < SEGMENTED_DECODE_MIN_KEYS * len(context_lens):
        return None
    return [key_rows(table, n, block_size, device) for table, n in zip(block_tables, context_lens)]


def shared_prefix_runs(prefix_blocks: list[int], block_size: int, device: torch.device) -> Keys | None:
    """The cache rows of a prefix that decodes share, for the fused path; None where it does not run."""
    if device.type != "cpu":
        return None
    return key_rows(prefix_blocks, len(prefix_blocks) * block_size, block_size, device)


def length_bias(context_lens: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias `[B, width]` that hides the keys past each sequence's length."""
    k_pos = torch.arange(width, device=context_lens.device).unsqueeze(0)
    bias = torch.zeros(context_lens.shape[0], width, dtype=dtype, device=context_lens.device)
    return bias.masked_fill_(k_pos >= context_lens.unsqueeze(1), float("-inf"))


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The keys (or values) of `blocks`, in order: `[len(blocks) * block_size, kv_heads, head_dim]`. One
    `index_select` of whole blocks of contiguous rows, far cheaper than indexing each key's slot."""
    kv_heads, dim = cache.shape[1:]
    return cache.view(-1, block_size, kv_heads, dim).index_select(0, blocks).view(-1, kv_heads, dim)


def _tokens_contiguous(x: torch.Tensor) -> bool:
    """Whether each token's `[heads, head_dim]` of `x [T, heads, head_dim]` is one run of memory."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys and values `[T, kv_heads, head_dim]` at their cache slots."""
    if (k_cache.dtype == key.dtype == value.dtype and k_cache.is_cpu and native.loaded() is not None
            and _tokens_contiguous(key) and _tokens_contiguous(value)):
        native.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    k_cache.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and optionally sliding-window) visibility of keys to queries, True = attend."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx_start: int,
                      scaling: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of one chunk `query [n, H, D]` over its context `key/value [L, Hkv, D]`,
    where the chunk's tokens are the last n of the L context positions."""
    n, length = query.shape[0], key.shape[0]
    q = query.transpose(0, 1).unsqueeze(0)
    k = key.transpose(0, 1).unsqueeze(0)
    v = value.transpose(0, 1).unsqueeze(0)
    if ctx_start == 0 and sliding_window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        q_pos = torch.arange(length - n, length, device=query.device).unsqueeze(1)
        k_pos = torch.arange(length, device=query.device).unsqueeze(0)
        mask = _window_mask(q_pos, k_pos, sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, context_lens: torch.Tensor, scaling: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Batched attention of one query per sequence `query [B, H, D]` over paged keys: the plain
    reference that `paged_decode_attention` must match.

    `slots [B, Lmax]` addresses each sequence's keys, padded; `context_lens [B]` masks the padding."""
    k = k_cache[slots].transpose(1, 2)  # [B, Hkv, Lmax, D]
    v = v_cache[slots].transpose(1, 2)
    k_pos = torch.arange(slots.shape[1], device=query.device).unsqueeze(0)
    q_pos = (context_lens - 1).unsqueeze(1)
    mask = _window_mask(q_pos, k_pos, sliding_window)[:, None, None, :]
    out = F.scaled_dot_product_attention(query.unsqueeze(2), k.to(query.dtype), v.to(query.dtype),
                                         attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.squeeze(2)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, bias: torch.Tensor, block_size: int, scaling: float,
                           context_lens: torch.Tensor | None = None,
                           sliding_window: int | None = None) -> torch.Tensor:
    """`decode_attention` for the hot path. Keys are gathered a whole block at a time (one
    `index_select` of contiguous rows, not one index per key); the length mask comes as an additive
    `bias [B, W * block_size]` built once per step; and the query heads that share a KV head are
    folded into the query-length axis (`[B, Hkv, H/Hkv, D]`), so the KV heads are never repeated.

    `context_lens` is needed only with a sliding window."""
    batch, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    flat = block_tables.reshape(-1)
    k = gather_blocks(k_cache, flat, block_size).view(batch, -1, kv_heads, dim)
    v = gather_blocks(v_cache, flat, block_size).view(batch, -1, kv_heads, dim)
    if sliding_window is not None:
        k_pos = torch.arange(bias.shape[1], device=bias.device).unsqueeze(0)
        bias = bias.masked_fill(k_pos <= (context_lens - 1 - sliding_window).unsqueeze(1), float("-inf"))
    q = query.view(batch, kv_heads, heads // kv_heads, dim)
    k, v = k.transpose(1, 2).to(query.dtype), v.transpose(1, 2).to(query.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None, None, :].to(query.dtype), scale=scaling)
    return out.reshape(batch, heads, dim)


def shared_prefix_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   blocks: torch.Tensor, bias: torch.Tensor, block_size: int, scaling: float,
                                   shared_blocks: int, context_lens: torch.Tensor,
                                   sliding_window: int | None = None) -> torch.Tensor:
    """`paged_decode_attention` for decodes that all start from the same blocks (a prefix from the
    prefix cache): `blocks [1, W]` holds those `shared_blocks` once, then each decode's own blocks
    (padded to one width). The prefix's keys are gathered once, and the queries of every decode (and
    every head sharing a KV head) meet all the keys in one attention call, `bias [B * G, W * block_size]`
    (a row per decode and query head of a KV head, decode-major) hiding from each decode the others'
    keys and the padding. The prefix is thus read once, not once per decode: worth it while the own
    keys are few next to the prefix (the runner sees to that).

    `context_lens` counts each decode's keys, the prefix's included; it places the window when there is one."""
    batch, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    k = gather_blocks(k_cache, blocks[0], block_size).unsqueeze(0)  # [1, W * block_size, Hkv, D]
    v = gather_blocks(v_cache, blocks[0], block_size).unsqueeze(0)
    if sliding_window is not None:
        prefix_len = shared_blocks * block_size
        own_width = (bias.shape[1] - prefix_len) // batch
        positions = torch.cat([torch.arange(prefix_len, device=bias.device),
                               torch.arange(prefix_len, prefix_len + own_width, device=bias.device).repeat(batch)])
        oldest = (context_lens - sliding_window).repeat_interleave(group)  # the first position still in the window
        bias = bias.masked_fill(positions[None, :] < oldest[:, None], float("-inf"))
    q = query.view(batch, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, batch * group, dim)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2).to(query.dtype), v.transpose(1, 2).to(query.dtype),
                                         attn_mask=bias[None, None].to(query.dtype), scale=scaling)
    return out[0].view(kv_heads, batch, group, dim).transpose(0, 1).reshape(batch, heads, dim)


_current: AttentionMetadata | None = None


@contextmanager
def step_metadata(metadata: AttentionMetadata) -> Iterator[None]:
    """Make `metadata` the step's addressing that every attention layer of the forward inside reads
    (as vLLM's forward context): the model call itself then carries only token ids and positions."""
    global _current
    _current = metadata
    try:
        yield
    finally:
        _current = None


def current_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the step's metadata: run the model through "
                           "workers.model.runner.ModelRunner (inside kernels.attention.step_metadata)")
    return _current


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup, block_size: int,
                  scaling: float, sliding_window: int | None) -> torch.Tensor:
    if g.native and sliding_window is None:
        return native.paged_decode(q, k_cache, v_cache, g.block_tables, g.context_lens, block_size, scaling)
    if g.runs is not None and sliding_window is None:
        return segmented.decode(q, k_cache, v_cache, g.runs, scaling)
    if g.prefix_runs is not None and sliding_window is None:
        prefix_len = g.shared_blocks * block_size
        own_blocks = g.block_tables[0, g.shared_blocks :].view(g.end - g.start, -1)
        own_bias = length_bias(g.context_lens - prefix_len, own_blocks.shape[1] * block_size, q.dtype)
        return segmented.shared_prefix_decode(q, k_cache, v_cache, g.prefix_runs, own_blocks, own_bias, block_size,
                                              scaling)
    if g.shared_blocks:
        return shared_prefix_decode_attention(q, k_cache, v_cache, g.block_tables, g.bias, block_size, scaling,
                                              g.shared_blocks, g.context_lens, sliding_window)
    bias = length_bias(g.context_lens, g.block_tables.shape[1] * block_size, q.dtype) if g.bias is None else g.bias
    return paged_decode_attention(q, k_cache, v_cache, g.block_tables, bias, block_size, scaling, g.context_lens,
                                  sliding_window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, layer_idx: int,
           scaling: float, sliding_window: int | None) -> torch.Tensor:
    """One layer's attention over the step: `q [T, H, D]`, `k/v [T, Hkv, D]`; it also writes the new
    keys and values to the layer's cache. Rows past `md.num_tokens` are padding: they get zeros."""
    if getattr(md, "backend", None) == "triton":  # rqbatcher.kernels.triton_attention.FlatAttentionMetadata
        return md.attend(q, k, v, layer_idx, scaling, sliding_window)
    n = md.num_tokens
    k_cache, v_cache = md.kv_caches[layer_idx]
    if n < k.shape[0]:  # padding rows (a compiled forward's): not slicing otherwise saves ~2 us a layer
        k, v = k[:n], v[:n]
    write_kv(k, v, k_cache, v_cache, md.slot_mapping)
    if n == q.shape[0] and not md.prefills and len(md.decode_groups) == 1:  # all decodes, one group: no copy
        return _decode_group(q, k_cache, v_cache, md.decode_groups[0], md.block_size, scaling, sliding_window)
    out = torch.zeros_like(q) if n < q.shape[0] else torch.empty_like(q)
    for g in md.decode_groups:
        out[g.start : g.end] = _decode_group(q[g.start : g.end], k_cache, v_cache, g, md.block_size, scaling,
                                             sliding_window)
    for span in md.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        if span.native and sliding_window is None:
            out[rows] = native.prefill(q[rows], k_cache, v_cache, span.context_blocks, span.ctx_start,
                                       md.block_size, scaling)
            continue
        if span.context_runs is not None and sliding_window is None:
            out[rows] = segmented.prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span.context_runs, scaling)
            continue
        if span.context_blocks is None:
            ctx_k, ctx_v = k[rows], v[rows]
        else:
            length = span.ctx_start + span.q_len
            ctx_k = gather_blocks(k_cache, span.context_blocks, md.block_size)[:length].to(q.dtype)
            ctx_v = gather_blocks(v_cache, span.context_blocks, md.block_size)[:length].to(q.dtype)
        out[rows] = prefill_attention(q[rows], ctx_k, ctx_v, span.ctx_start, scaling, sliding_window)
    return out


@torch.library.custom_op("batcher::paged_attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scaling: float,
                       sliding_window: int) -> torch.Tensor:
    """`attend` on the current step's metadata, as an op opaque to torch.compile: a compiled forward
    then depends on the token count alone, not on block tables or the batch's layout. It reads (and
    writes the KV cache) outside the graph, so no CUDA graph may capture it."""
    return attend(q, k, v, current_metadata(), layer_idx, scaling, sliding_window or None)


@paged_attention_op.register_fake
def _(q, k, v, layer_idx, scaling, sliding_window):
    return torch.empty_like(q)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, **kwargs):
    """The transformers attention function: `query [1, H, T, D]`, `key/value [1, Hkv, T, D]`,
    returns `([1, T, H, D], None)`. Eager calls run `attend` directly; a compiled forward calls the op."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention softcapping and sinks are not supported")
    scaling = module.scaling if scaling is None else scaling
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    if torch.compiler.is_compiling():
        out = paged_attention_op(q, k, v, module.layer_idx, scaling, sliding_window or 0)
    else:  # the op's own dispatch costs ~20 us a layer, for nothing outside a graph
        out = attend(q, k, v, current_metadata(), module.layer_idx, scaling, sliding_window)
    return out.unsqueeze(0), None
