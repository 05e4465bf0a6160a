"""KV-cache block allocator: a free list of fixed-size blocks and per-sequence block tables.

The tensors live in the model runner; this module only hands out block numbers, so the
scheduler can plan memory in pure Python.
"""

from __future__ import annotations

from collections import deque


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Hands out block ids from a free list. Block `i` holds cache slots `[i*block_size, (i+1)*block_size)`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, for metrics."""
        return 1.0 - self.num_free / self.num_blocks

    def extra_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.extra_blocks(block_table, num_tokens) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to `block_table` until it holds `num_tokens` tokens."""
        extra = self.extra_blocks(block_table, num_tokens)
        if extra > self.num_free:
            raise MemoryError(f"need {extra} KV blocks, {self.num_free} free")
        block_table.extend(self._free.popleft() for _ in range(extra))

    def release(self, block_table: list[int]) -> None:
        """Return every block of a table to the free list and empty the table."""
        self._free.extend(block_table)
        block_table.clear()
