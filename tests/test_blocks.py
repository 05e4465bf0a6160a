import pytest

from batcher.blocks import BlockAllocator, blocks_needed


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


def test_grow_refuses_beyond_capacity_without_taking_blocks():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    table: list[int] = []
    assert not alloc.can_grow(table, 9)
    with pytest.raises(MemoryError):
        alloc.grow(table, 9)
    assert alloc.num_free == 2 and table == []


def test_tables_never_share_blocks():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    a, b = [], []
    alloc.grow(a, 5)
    alloc.grow(b, 6)
    assert not set(a) & set(b)
