"""KV-cache blocks: a pool of fixed-size blocks with reference counts, and the prefix cache over it.

The tensors live in the model runner; this module only hands out block numbers, so the scheduler
can plan memory in pure Python. Block `i` holds cache slots `[i*block_size, (i+1)*block_size)`.

Prefix caching, as vLLM v1's block pool does it:
- a *full* block is named by a hash of its parent block's hash and its own token ids
  (`chain_block_hashes`), so one hash names the whole prefix up to the end of its block;
- `cached_prefix` finds the longest run of a prompt's blocks already in the cache, and `share` takes a
  reference on each: a block is shared only once it is full, so nothing is ever written into a
  shared block and no copy-on-write is needed;
- a block whose last reference goes keeps its hash and joins the back of the free queue: a later
  prompt can still take it back, until it reaches the front and is handed out for new tokens
  (evicted). The free queue is therefore least-recently-used first.
With caching off the same pool is a plain free list: no hashes are kept and nothing is shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROOT_HASH = b""  # the parent of a sequence's first block
TOKEN_ARRAY_TYPE = "q"  # token ids as 64-bit integers in the hashed bytes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_block_hashes(token_ids: Sequence[int], block_size: int, hashes: list[bytes], num_blocks: int) -> None:
    """Extend `hashes` (those of the first blocks of `token_ids`) to the first `num_blocks` full blocks.

    SHA-256 over the parent's hash and the block's ids: a collision would hand a prompt another
    prompt's keys and values, so a 64-bit hash is not enough."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else ROOT_HASH
        block = array(TOKEN_ARRAY_TYPE, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(hashlib.sha256(parent + block.tobytes()).digest())


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and found there, as vLLM counts them: once per
    request, when it is first admitted (a preempted request's second admission is not counted)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    """The pool of KV blocks: reference counts, an LRU free queue, and the map from hash to cached block."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # Free blocks, the next to hand out first. A dict keeps insertion order and removes from the middle
        # in O(1), which a prefix hit on a free block needs.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks with no reference, cached or not: all can be handed out."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a sequence (cached free blocks count as free), for metrics."""
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    def extra_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(block_table))

    # ----- the prefix cache -----
    def cached_prefix(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `block_hashes`, in order (no reference taken)."""
        blocks = []
        if self.prefix_caching:
            for block_hash in block_hashes:
                block = self._cached.get(block_hash)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def can_allocate(self, num_new: int, shared: Iterable[int] = ()) -> bool:
        """Whether `num_new` fresh blocks can be handed out after `shared` (cached blocks) are taken:
        a shared block that is free leaves the free queue, so it counts against it too."""
        return num_new + sum(1 for b in shared if self._ref_counts[b] == 0) <= self.num_free

    def share(self, blocks: Iterable[int]) -> None:
        """Take a reference on each of `blocks` (cached blocks a new sequence starts from)."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def cache_full_blocks(self, block_table: list[int], block_hashes: list[bytes], start: int, end: int) -> None:
        """Name blocks `start..end-1` of a table, now full (or filled in the step being scheduled), by their
        hashes so later prompts find them. A hash already cached keeps its first block."""
        if not self.prefix_caching:
            return
        for block, block_hash in zip(block_table[start:end], block_hashes[start:end]):
            if block_hash not in self._cached and self._hashes[block] is None:
                self._cached[block_hash] = block
                self._hashes[block] = block_hash

    def uncache_unfilled(self, block_table: list[int], num_computed_tokens: int) -> set[int]:
        """Drop the hashes of a table's blocks past its computed tokens: they were named when scheduled,
        and their forward never ran (the sequence was preempted or failed in that step). Returns those
        blocks that another sequence shares: its keys and values there were never written."""
        dropped: set[int] = set()
        if not self.prefix_caching:
            return dropped
        for block in block_table[num_computed_tokens // self.block_size :]:
            block_hash = self._hashes[block]
            if block_hash is not None:
                del self._cached[block_hash]
                self._hashes[block] = None
                if self._ref_counts[block] > 1:
                    dropped.add(block)
        return dropped

    # ----- handing out and taking back -----
    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` fresh blocks, least recently freed first, evicting their cached hashes."""
        if num_blocks > self.num_free:
            raise MemoryError(f"need {num_blocks} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            block_hash = self._hashes[block]
            if block_hash is not None:
                del self._cached[block_hash]
                self._hashes[block] = None
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append fresh blocks to `block_table` until it holds `num_tokens` tokens."""
        block_table.extend(self.allocate(self.extra_blocks(block_table, num_tokens)))

    def release(self, block_table: list[int]) -> None:
        """Drop a table's references and empty it. Blocks left unreferenced join the free queue: cached ones
        at the back, last block first, so a prompt's tail (the least likely to be shared) is evicted before
        its head; uncached ones at the front, since they hold nothing a later prompt could take back."""
        for block in reversed(block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._hashes[block] is None:
                    self._free.move_to_end(block, last=False)
        block_table.clear()
