"""Block pool: the free queue, the pool on its own, freeing and lazy LRU eviction order."""

from __future__ import annotations

import pytest

from kvroute.events import BlockRemoved, BlockStored
from kvroute.replica.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock

from .pool_helpers import Req, free_ids, hashes, make, schedule, toks


# -- the free queue --------------------------------------------------------------------
def test_free_queue_popleft_append_and_middle_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 4, 2]
    q.remove(blocks[2])  # the tail
    q.remove(blocks[1])  # the head
    assert [b.block_id for b in q.get_all_free_blocks()] == [3, 4]
    assert len(q) == 2
    with pytest.raises(ValueError):
        q.remove(blocks[1])  # not in the queue
    with pytest.raises(ValueError):
        q.append(blocks[3])  # already in it
    with pytest.raises(ValueError):
        q.popleft_n(3)
    assert [b.block_id for b in q.popleft_n(2)] == [3, 4]
    with pytest.raises(ValueError):
        q.popleft()


# -- the pool on its own ---------------------------------------------------------------
def test_allocation_pops_head_and_usage_counts_held_blocks() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.free_blocks(reversed(got))
    assert pool.usage == 0.0
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([got[0]])
    pool.check_invariants()


def test_touch_pulls_a_free_block_out_of_the_queue() -> None:
    pool = BlockPool(4)
    blk = pool.blocks[2]
    pool.touch([blk])
    assert blk.ref_cnt == 1
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [0, 1, 3]
    pool.touch([blk])  # a second holder: not in the queue, just one more reference
    assert blk.ref_cnt == 2
    pool.free_blocks([blk, blk])
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [0, 1, 3, 2]
    pool.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(3)
    pool.blocks[1].ref_cnt = 1  # in the free queue yet held
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(3)
    pool.blocks[0].block_hash = b"x" * 16  # carries a hash the map does not know
    with pytest.raises(AssertionError):
        pool.check_invariants()


# -- freeing and eviction order ----------------------------------------------------------
def test_free_in_reverse_order_evicts_the_unique_tail_first() -> None:
    mgr = make(8)
    tokens = toks(100, 13)  # 3 full blocks + 1 partial
    h = hashes(tokens)
    a = Req("a", tokens)
    assert schedule(mgr, a) == 0
    assert mgr.get_block_ids("a") == [0, 1, 2, 3]
    mgr.take_events()
    mgr.free(a)
    assert free_ids(mgr) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert mgr.take_events() == []  # freeing evicts nothing
    # Five blocks: four never used, then the partial block (no hash): still no event.
    assert schedule(mgr, Req("b", toks(500, 20))) == 0
    assert not any(isinstance(e, BlockRemoved) for e in mgr.take_events())
    # The next one reuses block 2, the request's last full block: its hash goes first.
    assert schedule(mgr, Req("c", toks(900, 1))) == 0
    assert mgr.take_events() == [BlockRemoved([h[2]], "GPU")]
    pool = mgr.block_pool
    assert pool.get_cached_block(h[2]) is None
    assert pool.get_cached_block(h[0]) is pool.blocks[0]
    assert pool.get_cached_block(h[1]) is pool.blocks[1]


def test_lru_across_requests_and_a_hit_refreshes_recency() -> None:
    mgr = make(5)
    pool = mgr.block_pool
    ta, tb = toks(10, 8), toks(50, 8)
    ha, hb = hashes(ta), hashes(tb)
    a, b = Req("a", ta), Req("b", tb)
    schedule(mgr, a)
    schedule(mgr, b)
    mgr.free(a)
    mgr.free(b)
    assert free_ids(mgr) == [4, 1, 0, 3, 2]  # unused, then A (tail first), then B
    mgr.take_events()
    # D extends A's prompt: both of A's blocks hit and leave the queue; its two new blocks
    # are the head (never-used block 4) and then B's tail, whose hash is evicted.
    d = Req("d", [*ta, 7, 7, 7, 7, 7])
    assert schedule(mgr, d) == 8
    assert [blk.ref_cnt for blk in pool.blocks[:2]] == [1, 1]
    assert mgr.get_block_ids("d") == [0, 1, 4, 3]
    assert mgr.take_events()[0] == BlockRemoved([hb[1]], "GPU")  # B's tail, not A's
    mgr.free(d)
    # A's blocks were used most recently, so they now sit behind B's root.
    assert free_ids(mgr) == [2, 3, 4, 1, 0]
    assert schedule(mgr, Req("e", toks(900, 2))) == 0
    assert mgr.take_events() == [BlockRemoved([hb[0]], "GPU")]
    assert pool.get_cached_block(ha[0]) is not None and pool.get_cached_block(ha[1]) is not None


def test_lazy_eviction_emits_block_removed_exactly_when_a_cached_block_is_reused() -> None:
    mgr = make(3)
    pool = mgr.block_pool
    t = toks(1, 8)
    h = hashes(t)
    a = Req("a", t)
    schedule(mgr, a)
    assert [type(e) for e in mgr.take_events()] == [BlockStored]
    mgr.free(a)
    assert mgr.take_events() == []
    assert pool.get_cached_block(h[0]) is pool.blocks[0]  # free yet findable
    assert pool.get_cached_block(h[1]) is pool.blocks[1]
    assert pool.blocks[0].ref_cnt == 0
    schedule(mgr, Req("x", [9]))  # takes never-used block 2
    assert mgr.take_events() == []
    schedule(mgr, Req("y", [9]))  # takes block 1, A's tail
    assert mgr.take_events() == [BlockRemoved([h[1]], "GPU")]
    assert pool.get_cached_block(h[1]) is None
    assert pool.get_cached_block(h[0]) is pool.blocks[0]
    assert pool.blocks[1].block_hash is None
