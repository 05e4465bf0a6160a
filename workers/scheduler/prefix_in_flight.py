"""Shared prefixes computed once: prompt blocks that a running sequence is still prefilling.

The prefix cache names a block once it is scheduled, so a prompt that arrives while another with the same document
is part-way through its prefill finds only the blocks computed so far. Were it admitted, it would compute the rest
of the document again, beside the first. Instead it waits: `holder_of` names the running sequence that will fill
its next uncached block, and the scheduler admits it once that block is cached (a step or a few later), and runs
the holder's chunks at the waiter's urgency meanwhile (it joins the holder's prefill).
"""

from __future__ import annotations

from rqbatcher.workers.scheduler.blocks import chain_block_hashes
from rqbatcher.workers.scheduler.sequence import Sequence


class PrefixesInFlight:
    """The full prompt blocks of the running prefills, by hash: which sequence fills each one."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._holders: dict[bytes, Sequence] = {}

    def __bool__(self) -> bool:
        return bool(self._holders)

    def add(self, seq: Sequence) -> None:
        """Count `seq`'s full blocks as in flight (those already computed are cached: no one waits on them)."""
        end = seq.num_tokens // self.block_size
        chain_block_hashes(seq.token_ids, self.block_size, seq.block_hashes, end)
        for block_hash in seq.block_hashes[:end]:
            self._holders.setdefault(block_hash, seq)

    def holder_of(self, shareable: list[bytes], num_cached: int) -> Sequence | None:
        """The sequence prefilling the next block a waiting one could start from, past its `num_cached` cached
        ones (`shareable`: the hashes of the blocks it may share), or None."""
        return self._holders.get(shareable[num_cached]) if num_cached < len(shareable) else None

    def blocks_awaited(self, shareable: list[bytes], num_cached: int, holder: Sequence) -> int:
        """How many blocks past a waiting sequence's cached ones `holder` is still to fill: what waiting saves."""
        count = 0
        for block_hash in shareable[num_cached:]:
            if self._holders.get(block_hash) is not holder:
                break
            count += 1
        return count
