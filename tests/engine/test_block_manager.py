"""BlockManager: exact block ids, ref counts, prefix-cache hits, LRU eviction, copy-on-write."""
from __future__ import annotations

import pytest

from tritium.core.block_manager import BlockManager, hash_block_tokens
from tritium.sampling_params import SamplingParams
from tritium.core.sequence import Sequence

P = SamplingParams()


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, len(tokens), P)


def admit(bm: BlockManager, s: Sequence) -> int:
    """What the scheduler does for a waiting sequence: look up, allocate, compute everything."""
    hit = bm.get_computed_blocks(s)
    hits, n = hit.blocks, hit.num_tokens
    assert bm.allocate_slots(s, s.num_tokens - n, hit)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return n


def test_allocates_on_demand_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(6)))
    assert admit(bm, s) == 0
    assert s.block_table == [0, 1]
    assert [bm.blocks[i].ref_cnt for i in range(3)] == [1, 1, 0]
    # Appending within the partial block takes nothing; crossing a boundary takes one block.
    s.append_token(6)
    assert bm.allocate_slots(s, 1) and s.block_table == [0, 1]
    s.num_computed_tokens = 7
    s.append_token(7)
    assert bm.allocate_slots(s, 1) and s.block_table == [0, 1]
    s.num_computed_tokens = 8
    s.append_token(8)
    assert bm.allocate_slots(s, 1) and s.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.check_integrity([s])


def test_prefix_hit_shares_full_blocks_but_never_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)), "a")
    admit(bm, a)  # blocks 0,1 full and cached; block 2 partial
    assert a.block_table == [0, 1, 2]
    b = seq(list(range(8)) + [99, 98], "b")
    hit = bm.get_computed_blocks(b)
    hits, n = hit.blocks, hit.num_tokens
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert bm.allocate_slots(b, 2, hit)
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    # A prompt that is exactly two full blocks hits only the first: the last token is recomputed.
    c = seq(list(range(8)), "c")
    hit = bm.get_computed_blocks(c)
    hits, n = hit.blocks, hit.num_tokens
    assert [h.block_id for h in hits] == [0] and n == 4
    # A lookup counts once its blocks are taken (a sequence that cannot be admitted looks up
    # again at the next step).
    assert bm.prefix_cache_queries == 10 + 10 and bm.prefix_cache_hits == 0 + 8
    assert bm.allocate_slots(c, 4, hit)
    assert bm.prefix_cache_queries == 10 + 10 + 8 and bm.prefix_cache_hits == 0 + 8 + 4
    bm.check_integrity([a, b, c])


def test_chained_hash_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, seq([1, 2, 3, 4, 5]))
    other = seq([9, 9, 3, 4, 5], "o")  # same second block, different first block
    hit = bm.get_computed_blocks(other)
    hits, n = hit.blocks, hit.num_tokens
    assert hits == [] and n == 0
    assert hash_block_tokens(None, (1, 2)) != hash_block_tokens(None, (9, 9))


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")   # blocks 0,1 (full, cached), 2 (partial)
    admit(bm, a)
    bm.free(a)
    # Freed tail first: the free queue is [3, 2, 1, 0] (3 never used).
    assert list(bm.free_queue) == [3, 2, 1, 0]
    assert bm.usage == 0.0 and len(bm.cached_blocks) == 2
    b = seq([1, 2, 3, 4, 7], "b")  # hits both cached blocks even though a is gone
    hit = bm.get_computed_blocks(b)
    hits, n = hit.blocks, hit.num_tokens
    assert [h.block_id for h in hits] == [0, 1] and n == 4
    assert bm.allocate_slots(b, 1, hit)
    assert b.block_table == [0, 1, 3]
    bm.free(b)
    assert list(bm.free_queue) == [2, 3, 1, 0]
    # A new unrelated prompt of 4 blocks takes 2, 3, then evicts 1 and 0 (least recent first).
    c = seq([50, 51, 52, 53, 54, 55, 56], "c")
    admit(bm, c)
    assert c.block_table == [2, 3, 1, 0]
    assert bm.cached_blocks.keys() == {hash_block_tokens(None, (50, 51)),
                                       hash_block_tokens(hash_block_tokens(None, (50, 51)), (52, 53)),
                                       hash_block_tokens(hash_block_tokens(hash_block_tokens(None, (50, 51)), (52, 53)), (54, 55))}
    bm.check_integrity([c])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4], "a")
    admit(bm, a)
    b = seq([9, 8, 7, 6, 5], "b")
    assert not bm.allocate_slots(b, 5)
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.check_integrity([a])


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(list(range(6)), "p")
    admit(bm, parent)
    assert parent.block_table == [0, 1]
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == [0, 1]
    assert [bm.blocks[0].ref_cnt, bm.blocks[1].ref_cnt] == [2, 2]
    # The child writes its first token into shared partial block 1: it gets a copy.
    child.append_token(42)
    assert bm.allocate_slots(child, 1)
    assert child.block_table == [0, 2]
    assert bm.take_copies() == [(1, 2)]
    assert [bm.blocks[i].ref_cnt for i in range(3)] == [2, 1, 1]
    # The parent now holds block 1 alone and writes in place.
    parent.append_token(7)
    assert bm.allocate_slots(parent, 1)
    assert parent.block_table == [0, 1] and bm.take_copies() == []
    bm.check_integrity([parent, child])
    bm.free(parent)
    bm.free(child)
    bm.check_integrity([])
    assert bm.usage == 0.0


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(list(range(8)), "p")
    admit(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    child.append_token(1)
    assert bm.allocate_slots(child, 1)
    assert child.block_table == [0, 1, 2] and bm.take_copies() == []


def test_integrity_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3], "a")
    admit(bm, a)
    bm.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="has 1 references"):
        bm.check_integrity([a])
    bm.blocks[0].ref_cnt -= 1
    bm.free_queue[0] = bm.blocks[0]
    with pytest.raises(AssertionError, match="is in use and free"):
        bm.check_integrity([a])
