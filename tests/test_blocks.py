"""The KV block pool alone (pure Python): allocation, reference counts, hash chains, the LRU free queue."""

import pytest

from rqbatcher.workers.scheduler.blocks import BlockAllocator, PrefixCacheStats, blocks_needed, chain_block_hashes


def hashes_of(tokens, block_size):
    hashes: list[bytes] = []
    chain_block_hashes(tokens, block_size, hashes, len(tokens) // block_size)
    return hashes


def filled(alloc, tokens):
    """A table holding `tokens`, its full blocks named in the cache (as a computed prompt's are)."""
    table = alloc.allocate(blocks_needed(len(tokens), alloc.block_size))
    hashes = hashes_of(tokens, alloc.block_size)
    alloc.cache_full_blocks(table, hashes, 0, len(hashes))
    return table, hashes


def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_grow_and_release_round_trip():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    table: list[int] = []
    alloc.grow(table, 5)
    assert len(table) == 2 and alloc.num_free == 2 and alloc.usage == 0.5
    alloc.grow(table, 8)  # still fits in two blocks
    assert len(table) == 2
    alloc.release(table)
    assert table == [] and alloc.num_free == 4 and alloc.usage == 0.0


def test_allocation_beyond_capacity_is_refused_without_taking_blocks():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    table: list[int] = []
    assert not alloc.can_allocate(alloc.extra_blocks(table, 9))
    with pytest.raises(MemoryError):
        alloc.grow(table, 9)
    assert alloc.num_free == 2 and table == []


def test_tables_never_share_fresh_blocks():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    a, b = [], []
    alloc.grow(a, 5)
    alloc.grow(b, 6)
    assert not set(a) & set(b)


def test_a_block_hash_covers_its_whole_prefix():
    base = list(range(100, 112))
    same, late_change, early_change = list(base), base[:8] + [7] + base[9:], [7] + base[1:]
    assert hashes_of(same, 4) == hashes_of(base, 4)
    assert hashes_of(late_change, 4)[:2] == hashes_of(base, 4)[:2]
    assert hashes_of(late_change, 4)[2] != hashes_of(base, 4)[2]
    assert not set(hashes_of(early_change, 4)) & set(hashes_of(base, 4))  # a change reaches every later block
    assert len(hashes_of(base[:11], 4)) == 2  # the partial third block has no hash


def test_a_prefix_is_found_and_shared_by_reference():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    prompt = list(range(10, 22))
    table, hashes = filled(alloc, prompt)
    other = hashes_of(prompt[:8] + [1, 2, 3, 4], 4)
    shared = alloc.cached_prefix(other)
    assert shared == table[:2]  # the third block differs
    alloc.share(shared)
    assert [alloc.ref_count(b) for b in table] == [2, 2, 1]
    alloc.release(list(table))
    assert [alloc.ref_count(b) for b in shared] == [1, 1] and not alloc.is_free(shared[0])
    assert alloc.num_free == 8 - 2


def test_a_freed_block_keeps_its_hash_until_it_is_evicted_least_recent_first():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    old, old_hashes = filled(alloc, [10, 11, 12, 13])
    alloc.release(list(old))
    recent, recent_hashes = filled(alloc, [20, 21, 22, 23])  # takes the two blocks that never held anything
    alloc.release(list(recent))
    assert alloc.num_free == 4 and alloc.usage == 0.0
    assert alloc.cached_prefix(old_hashes) and alloc.cached_prefix(recent_hashes)  # both still cached
    (evicted,) = alloc.allocate(1)
    assert evicted == old[-1]  # the older prompt, its tail first
    assert alloc.cached_prefix(old_hashes) == old[:1] and len(alloc.cached_prefix(recent_hashes)) == 2


def test_taking_back_a_free_cached_block_counts_against_the_free_blocks():
    alloc = BlockAllocator(num_blocks=3, block_size=2)
    table, hashes = filled(alloc, [10, 11, 12, 13])
    alloc.release(table)
    shared = alloc.cached_prefix(hashes)
    assert alloc.can_allocate(1, shared) and not alloc.can_allocate(2, shared)
    alloc.share(shared)
    assert alloc.num_free == 1 and alloc.allocate(1) not in shared


def test_a_block_that_was_never_filled_leaves_the_cache_and_its_sharers_are_named():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    table, hashes = filled(alloc, [10, 11, 12, 13, 14, 15])  # named when scheduled...
    alloc.share(alloc.cached_prefix(hashes[:2]))  # ...and another sequence starts from two of them
    assert alloc.uncache_unfilled(table, num_computed_tokens=2) == {table[1]}  # ...but only 2 tokens were computed
    assert alloc.cached_prefix(hashes) == table[:1]


def test_the_same_content_keeps_its_first_block():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    first, hashes = filled(alloc, [10, 11])
    second, _ = filled(alloc, [10, 11])
    assert alloc.cached_prefix(hashes) == first
    alloc.release(list(second))
    assert alloc.allocate(1) == second  # an uncached block is handed out before cached ones


def test_with_caching_off_nothing_is_named_or_found():
    alloc = BlockAllocator(num_blocks=4, block_size=2, prefix_caching=False)
    table, hashes = filled(alloc, [10, 11, 12, 13])
    assert alloc.cached_prefix(hashes) == []
    assert alloc.uncache_unfilled(table, 0) == set()


def test_hit_rate():
    assert PrefixCacheStats().hit_rate == 0.0
    assert PrefixCacheStats(queries=200, hits=150).hit_rate == 0.75
