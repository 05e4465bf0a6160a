"""The Triton attention backend: the step's flat metadata, and the layer call that runs the kernels.

The torch backend (`rqbatcher.kernels.attention`) plans decode groups and prefill spans and attends each with SDPA.
This one hands the kernels (`rqbatcher.kernels.triton_kernels`) flat arrays instead, built by the runner once per
step and moved to the device in one copy: where each sequence's queries start, each sequence's length, and
a padded block table. Each layer then costs two launches (three when long contexts are split): store the
new keys and values, and attend.

`rqbatcher.kernels.attention.attend` hands a layer to `FlatAttentionMetadata.attend` when the step's metadata is of
this kind (its `backend` says so), so the transformers attention function and the compiled op are shared.

triton is imported only when a kernel first runs, so `import kernels` and the torch path never need it.
On a CPU the kernels run only under `TRITON_INTERPRET=1` (slowly: that is how the tests check them);
`rqbatcher.workers.model.attention_backend` picks the backend and refuses one that cannot run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

TRITON = "triton"
# Launch shapes. A query tile holds up to QUERY_TILE_ROWS (query token, query head) rows; decode-only steps
# shrink it to one token per program. Keys are read KV_TILE positions at a time.
QUERY_TILE_ROWS = 64
KV_TILE = 32
# Split-KV: long contexts are shared by several programs while the step alone would leave the GPU idle.
PROGRAMS_PER_SM = 2
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Programs that keep `device` busy: a few per SM on a GPU; one on a CPU (the interpreter runs them in turn)."""
    if device.type != "cuda":
        return 1
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class FlatAttentionMetadata:
    """One step's addressing for the Triton kernels, built once per step and shared by every layer.

    Sequence i owns the batch rows `[query_start[i], query_start[i + 1])`: its new tokens, which are the
    last of its `seq_lens[i]` cache positions; `block_tables[i]` lists its KV blocks (padded with 0)."""

    backend: ClassVar[str] = TRITON
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    num_tokens: int  # the step's real tokens; a compiled forward may run on more rows (padding)
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int32, cache slot of every new token
    query_start: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max blocks] int32
    max_query_len: int
    max_seq_len: int

    @classmethod
    def build(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
              sequences: list[tuple[list[int], int, int]], slot_mapping: list[int],
              device: torch.device) -> FlatAttentionMetadata:
        """From `(block_table, first_position, num_new_tokens)` of each sequence in batch-row order and the
        new tokens' slots. Every array goes to the device in one copy."""
        query_start = [0]
        seq_lens = []
        for _, first, n in sequences:
            query_start.append(query_start[-1] + n)
            seq_lens.append(first + n)
        width = max((len(table) for table, _, _ in sequences), default=0)
        tables = [b for table, _, _ in sequences for b in table + [0] * (width - len(table))]
        packed = torch.tensor(query_start + seq_lens + slot_mapping + tables, dtype=torch.int32)
        packed = packed.to(device, non_blocking=True)
        num_seqs, num_tokens = len(sequences), query_start[-1]
        views = packed.split([num_seqs + 1, num_seqs, num_tokens, num_seqs * width])
        return cls(kv_caches, num_tokens, block_size, views[2], views[0], views[1], views[3].view(num_seqs, width),
                   max((n for _, _, n in sequences), default=0), max(seq_lens, default=0))

    @classmethod
    def idle(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
             device: torch.device) -> FlatAttentionMetadata:
        """A step with no real token (every row is padding): what compiling a graph runs."""
        return cls.build(kv_caches, block_size, [], [], device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scaling: float,
               sliding_window: int | None) -> torch.Tensor:
        """`rqbatcher.kernels.attention.attend` for this step: `q [T, H, D]`, `k/v [T, Hkv, D]`; writes the new keys and
        values to the layer's cache first. Rows past `num_tokens` are padding: they get zeros."""
        from rqbatcher.kernels import triton_kernels

        n = self.num_tokens
        k_cache, v_cache = self.kv_caches[layer_idx]
        triton_kernels.store_kv(k[:n], v[:n], k_cache, v_cache, self.slot_mapping)
        out = torch.empty_like(q) if n == q.shape[0] else torch.zeros_like(q)
        num_splits = triton_kernels.splits_for(self.seq_lens.shape[0] * k_cache.shape[1], self.max_seq_len,
                                               _target_programs(q.device), MIN_KEYS_PER_SPLIT, MAX_SPLITS)
        triton_kernels.paged_attention(q, k_cache, v_cache, out, self.block_tables, self.query_start,
                                       self.seq_lens, n, self.max_query_len, self.block_size, scaling,
                                       sliding_window, num_splits, KV_TILE, QUERY_TILE_ROWS)
        return out
