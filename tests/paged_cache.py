"""A paged KV cache with scattered blocks, for the attention kernels' tests."""

import torch


def scattered_cache(lengths, block_size, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """A cache and block tables whose blocks are shuffled, so no sequence's keys are contiguous."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    blocks = torch.randperm(sum(needed) + 3, generator=generator)
    width = max(needed)
    tables, start = [], 0
    for count in needed:
        tables.append(blocks[start : start + count].tolist() + [0] * (width - count))  # padding: never read
        start += count
    shape = ((sum(needed) + 3) * block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    return k_cache, v_cache, torch.tensor(tables)


def cache_slots(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each sequence's cache rows `[B, W * block_size]`, from its block table (padding included)."""
    return (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(len(tables), -1)
