"""KV cache manager: the lookup, allocation failures, the events it emits, counters."""

from __future__ import annotations

import pytest

from kvroute.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockSet,
    BlockStored,
    to_external,
)
from kvroute.replica.core.block_pool import BlockPool

from .pool_helpers import B, Req, free_ids, hashes, make, schedule, toks


# -- the lookup --------------------------------------------------------------------------
def test_lookup_touches_nothing_until_allocation_and_hit_blocks_are_protected() -> None:
    mgr = make(5)
    pool = mgr.block_pool
    t = toks(1, 8)
    a = Req("a", t)
    schedule(mgr, a)
    mgr.free(a)  # queue: 2, 3, 4, 1, 0
    b = Req("b", [*t, 5])
    blocks, n = mgr.get_computed_blocks(b)
    assert (n, [x.block_id for x in blocks]) == (8, [0, 1])
    assert pool.blocks[0].ref_cnt == 0  # the lookup alone changes nothing
    assert mgr.allocate_slots(b, 1, n, blocks) is not None
    assert [pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    assert 0 not in free_ids(mgr) and 1 not in free_ids(mgr)
    mgr.take_events()
    assert mgr.get_block_ids("b") == [0, 1, 2]
    schedule(mgr, Req("c", toks(70, 8)))  # the two remaining blocks: none of the hits
    assert mgr.get_block_ids("c") == [3, 4]
    assert mgr.take_events() == [
        BlockStored(hashes(toks(70, 8)), None, toks(70, 8), B, None, "GPU", None)
    ]


def test_lookup_stops_at_the_first_miss() -> None:
    mgr = make(5)
    pool = mgr.block_pool
    t = toks(1, 13)
    h = hashes(t)
    a = Req("a", t)
    schedule(mgr, a)
    mgr.free(a)  # queue: 4, 3 (partial), 2, 1, 0
    pool.touch([pool.blocks[2]])  # keep block 2 out of the way
    taken = pool.get_new_blocks(3)  # 4, 3, then 1: h[1] evicted, h[0] and h[2] survive
    assert [x.block_id for x in taken] == [4, 3, 1]
    pool.free_blocks([*taken, pool.blocks[2]])
    assert pool.get_cached_block(h[1]) is None
    assert pool.get_cached_block(h[0]) is not None and pool.get_cached_block(h[2]) is not None
    blocks, n = mgr.get_computed_blocks(Req("b", t))
    assert n == B and [x.block_id for x in blocks] == [0]


@pytest.mark.parametrize(
    ("prompt_len", "expected_hit"), [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)]
)
def test_hit_is_capped_at_prompt_len_minus_one(prompt_len: int, expected_hit: int) -> None:
    mgr = make(16)
    long = toks(1, 16)
    a = Req("a", long)
    schedule(mgr, a)
    mgr.free(a)
    blocks, n = mgr.get_computed_blocks(Req("b", long[:prompt_len]))
    assert n == expected_hit
    assert n <= prompt_len - 1
    assert len(blocks) * B == n


def test_whole_prompt_cached_recomputes_last_block_into_a_duplicate_copy() -> None:
    mgr = make(6)
    pool = mgr.block_pool
    t = toks(1, 8)
    h = hashes(t)
    a = Req("a", t)
    schedule(mgr, a)
    mgr.take_events()
    b = Req("b", list(t))
    assert schedule(mgr, b) == B  # 8 cached, 7 allowed: only block 0 is a hit
    assert mgr.take_events() == [BlockStored([h[1]], h[0], t[4:8], B, None, "GPU", None)]
    assert len(pool.cached_block_hash_to_block[h[1]]) == 2
    assert pool.cached_hash_counts() == {h[0]: 1, h[1]: 2}
    pool.check_invariants()


def test_a_different_cache_salt_or_lora_never_hits() -> None:
    mgr = make(32)
    t = toks(1, 12)
    a = Req("a", t, cache_salt="tenant-1")
    schedule(mgr, a)
    mgr.free(a)
    for other in (
        Req("b", t, cache_salt="tenant-2"),
        Req("c", t),
        Req("d", t, cache_salt="tenant-1", lora_name="adapter"),
    ):
        assert mgr.get_computed_blocks(other) == ([], 0)
    assert mgr.get_computed_blocks(Req("e", t, cache_salt="tenant-1"))[1] == 8
    lo = Req("f", t, lora_name="adapter")
    mgr.take_events()
    schedule(mgr, lo)
    (ev,) = mgr.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.lora_name == "adapter" and ev.block_hashes == hashes(t, lora="adapter")
    mgr.free(lo)
    assert mgr.get_computed_blocks(Req("g", t, lora_name="adapter"))[1] == 8
    assert mgr.get_computed_blocks(Req("h", t, lora_name="other"))[1] == 0


def test_concurrent_duplicates_are_counted_per_copy() -> None:
    mgr = make(4)
    pool = mgr.block_pool
    t = toks(1, 8)
    h = hashes(t)
    a, b = Req("a", t), Req("b", list(t))
    la, lb = mgr.get_computed_blocks(a), mgr.get_computed_blocks(b)  # both miss
    assert la == lb == ([], 0)
    assert mgr.allocate_slots(a, 8) is not None
    assert mgr.allocate_slots(b, 8) is not None
    replay = BlockSet()
    for ev in mgr.take_events():
        replay.apply(ev)
    assert replay.counts() == pool.cached_hash_counts() == {h[0]: 2, h[1]: 2}
    assert pool.get_cached_block(h[0]) in (pool.blocks[0], pool.blocks[2])
    mgr.free(a)
    schedule(mgr, Req("x", toks(50, 8)))  # reuses both of A's copies
    evs = mgr.take_events()
    assert evs[0] == BlockRemoved([h[1], h[0]], "GPU")
    for ev in evs:
        replay.apply(ev)
    assert replay.counts() == pool.cached_hash_counts()
    assert replay.count(h[0]) == replay.count(h[1]) == 1
    assert pool.get_cached_block(h[0]) is pool.blocks[2]  # B's copy still serves hits
    pool.check_invariants()


# -- allocation failures -----------------------------------------------------------------
def test_allocation_failure_changes_nothing_and_counts_free_hits_as_used() -> None:
    mgr = make(3)
    pool = mgr.block_pool
    t = toks(1, 8)
    a = Req("a", t)
    schedule(mgr, a)
    mgr.free(a)
    mgr.take_events()
    before = free_ids(mgr)
    b = Req("b", [*t, *toks(40, 5)])  # hits 2 free blocks, needs 2 more: 3 - 2 < 2
    blocks, n = mgr.get_computed_blocks(b)
    assert n == 8
    assert mgr.allocate_slots(b, 5, n, blocks) is None
    assert free_ids(mgr) == before
    assert all(x.ref_cnt == 0 for x in pool.blocks)
    assert mgr.get_block_ids("b") == [] and mgr.take_events() == []
    mgr.free(b)
    pool.check_invariants()


def test_a_hit_evicted_before_allocation_is_refused() -> None:
    mgr = make(2)
    t = toks(1, 5)
    a = Req("a", t)
    schedule(mgr, a)
    mgr.free(a)
    b = Req("b", t)
    blocks, n = mgr.get_computed_blocks(b)
    assert n == B
    schedule(mgr, Req("x", toks(50, 8)))  # takes both blocks, evicting the hit
    with pytest.raises(ValueError, match="evicted"):
        mgr.allocate_slots(b, 1, n, blocks)


def test_bad_arguments() -> None:
    mgr = make(4)
    r = Req("r", toks(1, 6))
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, 0)
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, 7)  # more tokens than the request has
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(4, hash_form="hex")  # type: ignore[arg-type]


# -- events ------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["bytes", "int"])
def test_block_stored_fields_chunked_prefill_and_decode(form: str) -> None:
    mgr = make(8, hash_form=form, medium="CPU")
    t = toks(1, 14)
    r = Req("r", t, cache_salt="s", lora_name="L")

    def ext(i: int) -> object:
        return to_external(hashes(r.all_token_ids, salt="s", lora="L")[i], form)  # type: ignore[arg-type]

    assert schedule(mgr, r, 6) == 0
    assert mgr.take_events() == [BlockStored([ext(0)], None, t[0:4], B, None, "CPU", "L")]
    assert mgr.allocate_slots(r, 6) is not None
    r.num_computed_tokens += 6
    assert mgr.take_events() == [
        BlockStored([ext(1), ext(2)], ext(0), t[4:12], B, None, "CPU", "L")
    ]
    assert mgr.allocate_slots(r, 2) is not None  # 14 tokens: block 3 still partial
    r.num_computed_tokens += 2
    assert mgr.take_events() == []
    for tok in (77, 78):  # decode: the sampled token is appended, then scheduled
        r.all_token_ids.append(tok)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    assert mgr.take_events() == [
        BlockStored([ext(3)], ext(2), [13, 14, 77, 78], B, None, "CPU", "L")
    ]
    assert mgr.get_block_ids("r") == [0, 1, 2, 3]


def test_delay_cache_blocks_registers_only_on_cache_blocks() -> None:
    mgr = make(4)
    t = toks(1, 8)
    r = Req("r", t)
    assert mgr.allocate_slots(r, 8, delay_cache_blocks=True) is not None
    assert mgr.take_events() == [] and mgr.get_computed_blocks(Req("q", [*t, 1]))[1] == 0
    r.num_computed_tokens = 8
    mgr.cache_blocks(r, 8)
    assert [type(e) for e in mgr.take_events()] == [BlockStored]
    assert mgr.get_computed_blocks(Req("q2", [*t, 1]))[1] == 8


def test_reset_refused_while_blocks_are_in_use() -> None:
    mgr = make(4)
    pool = mgr.block_pool
    t = toks(1, 8)
    a = Req("a", t)
    schedule(mgr, a)
    mgr.take_events()
    assert mgr.reset_prefix_cache() is False
    assert mgr.take_events() == []
    assert pool.get_cached_block(hashes(t)[0]) is not None
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert mgr.get_computed_blocks(Req("b", [*t, 1])) == ([], 0)
    schedule(mgr, Req("c", toks(50, 16)))  # reuses every block: nothing left to evict
    assert not any(isinstance(e, BlockRemoved) for e in mgr.take_events())
    pool.check_invariants()


def test_counters_in_tokens_and_usage() -> None:
    mgr = make(10)
    t = toks(1, 10)
    a = Req("a", t)
    schedule(mgr, a)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (10, 0)
    assert mgr.usage == pytest.approx(0.3)
    b = Req("b", [*t, 5, 6])
    schedule(mgr, b)  # shares blocks 0 and 1, adds one block
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (22, 8)
    assert mgr.usage == pytest.approx(0.4)
    mgr.free(a)
    assert mgr.usage == pytest.approx(0.3)  # A's partial block; the shared ones stay held
    mgr.free(b)
    assert mgr.usage == 0.0


def test_caching_disabled_means_no_hits_no_hashes_no_events() -> None:
    mgr = make(4, enable_caching=False)
    t = toks(1, 8)
    a = Req("a", t)
    schedule(mgr, a)
    mgr.free(a)
    assert mgr.get_computed_blocks(Req("b", [*t, 1])) == ([], 0)
    assert mgr.take_events() == []
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    mgr.block_pool.check_invariants()
