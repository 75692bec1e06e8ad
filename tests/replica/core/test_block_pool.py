"""Block pool and KV cache manager: lazy LRU, reverse-order free, hits, events, invariants."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvroute.events import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockSet,
    BlockStored,
    to_external,
)
from kvroute.replica.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvroute.replica.core.kv_cache_manager import KVCacheManager

B = 4  # block size used throughout


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    skip_reading_prefix_cache: bool = False


def make(num_blocks: int, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BlockHasher(block_size=B), **kw)


def schedule(mgr: KVCacheManager, req: Req, num_new_tokens: int | None = None) -> int | None:
    """Lookup + allocate for a fresh request, as the scheduler would; returns the hit tokens."""
    blocks, n = mgr.get_computed_blocks(req)
    k = len(req.all_token_ids) - n if num_new_tokens is None else num_new_tokens
    if mgr.allocate_slots(req, k, n, blocks) is None:
        return None
    req.num_computed_tokens = n + k
    return n


def hashes(tokens: list[int], salt: str | None = None, lora: str | None = None) -> list[bytes]:
    return BlockHasher(block_size=B).hash_blocks(tokens, cache_salt=salt, lora_name=lora)


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


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


# -- the property tests -----------------------------------------------------------------
SYSTEM_PROMPTS = [[], [1, 2, 3, 1, 2], [7, 7, 7, 7, 1, 2, 3, 4, 5]]


class PoolModel:
    """A manager under random ops, with what the test knows independently of it: the live
    requests and, per physical block, the prefix (salt and LoRA included) last written there.

    Ops: admit (lookup + allocate a chunk), step (next prefill chunk, or append a decode
    token and schedule it; dropped when out of blocks), finish, preempt-and-resume, reset.
    A small pool makes allocation evict constantly."""

    def __init__(self, num_blocks: int, hash_form: str) -> None:
        self.mgr = make(num_blocks, hash_form=hash_form)
        self.form = hash_form
        self.queue = list(range(num_blocks))  # the expected free queue, head first
        self.queries = self.hits = 0
        self.live: dict[str, Req] = {}
        self.content: dict[int, tuple] = {}
        self.history: list[tuple[list[int], str | None, str | None]] = []
        self.replay = BlockSet()  # fed every event ever emitted, from empty
        self.n = 0
        self.seen: Counter[str] = Counter()  # what happened, for coverage checks

    def _write(self, req: Req, start: int, end: int) -> None:
        """The forward pass: tokens [start, end) of req land in its blocks."""
        table = self.mgr.req_to_blocks[req.request_id]
        key = (req.cache_salt, req.lora_name)
        for j in range(start // B, -(-end // B)):
            prefix = tuple(req.all_token_ids[: min(end, (j + 1) * B)])
            self.content[table[j].block_id] = (key, prefix)

    def _allocated(self, hit: list[KVCacheBlock], new: list[KVCacheBlock]) -> None:
        """LRU by the book: hits leave the queue, new blocks come off its head."""
        for b in hit:
            if b.block_id in self.queue:
                self.queue.remove(b.block_id)
        assert [b.block_id for b in new] == self.queue[: len(new)]
        del self.queue[: len(new)]

    def _free(self, req: Req) -> None:
        """Reverse order: the request's blocks that nobody else holds join the tail."""
        table = self.mgr.req_to_blocks.get(req.request_id, [])
        others = Counter(
            b.block_id for r, t in self.mgr.req_to_blocks.items() if r != req.request_id for b in t
        )
        self.queue += [b.block_id for b in reversed(table) if not others[b.block_id]]
        self.mgr.free(req)

    def _pick(self, i: int) -> Req | None:
        return self.live[sorted(self.live)[i % len(self.live)]] if self.live else None

    def admit(self, tokens: list[int], salt: str | None, lora: str | None, chunk: int) -> None:
        self.n += 1
        self.history.append((tokens, salt, lora))
        self._admit(Req(f"r{self.n}", list(tokens), 0, salt, lora), chunk)

    def admit_again(self, i: int, chunk: int) -> None:
        if self.history:
            self.admit(*self.history[i % len(self.history)], chunk)

    def _admit(self, req: Req, chunk: int) -> None:
        blocks, n = self.mgr.get_computed_blocks(req)
        key = (req.cache_salt, req.lora_name)
        for i, blk in enumerate(blocks):  # a hit must hold exactly this request's prefix
            assert self.content[blk.block_id] == (key, tuple(req.all_token_ids[: (i + 1) * B]))
        assert n < len(req.all_token_ids)
        self.queries += len(req.all_token_ids)
        self.hits += n
        k = min(chunk, len(req.all_token_ids) - n)
        self.seen["hit" if n else "miss"] += 1
        new = self.mgr.allocate_slots(req, k, n, blocks)
        if new is None:
            self.seen["out of blocks"] += 1
            self.mgr.free(req)
            return
        self._allocated(blocks, new)
        self._write(req, n, n + k)
        req.num_computed_tokens = n + k
        self.live[req.request_id] = req

    def step(self, i: int, chunk: int, tok: int) -> None:
        req = self._pick(i)
        if req is None:
            return
        if req.num_computed_tokens == len(req.all_token_ids):
            req.all_token_ids.append(tok)  # decode: the sampled token joins the request
            chunk = 1
        start = req.num_computed_tokens
        k = min(chunk, len(req.all_token_ids) - start)
        new = self.mgr.allocate_slots(req, k)
        if new is None:
            self._free(self.live.pop(req.request_id))
            return
        self._allocated([], new)
        self._write(req, start, start + k)
        req.num_computed_tokens += k

    def finish(self, i: int) -> None:
        req = self._pick(i)
        if req is not None:
            self._free(self.live.pop(req.request_id))

    def preempt_and_resume(self, i: int, chunk: int) -> None:
        req = self._pick(i)
        if req is None:
            return
        self._free(self.live.pop(req.request_id))
        req.num_computed_tokens = 0
        self._admit(req, chunk)

    def reset(self) -> None:
        ok = self.mgr.reset_prefix_cache()
        self.seen[f"reset {ok}"] += 1
        assert ok == (not self.live)

    def check(self) -> None:
        mgr, pool = self.mgr, self.mgr.block_pool
        pool.check_invariants()
        for ev in mgr.take_events():
            self.seen[type(ev).__name__] += 1
            self.replay.apply(ev)
        counts = pool.cached_hash_counts()
        assert self.replay.counts() == counts
        assert self.replay.unknown_removals == 0
        if any(c > 1 for c in counts.values()):
            self.seen["duplicate copies"] += 1
        # Each cached block: its hash names what it holds, and the stream told its parent
        # and tokens right (the content model knows them independently of the pool).
        records = self.replay.records()
        for b in pool.blocks:
            if b.block_hash is None:
                continue
            (salt, lora), prefix = self.content[b.block_id]
            assert len(prefix) % B == 0
            chain = hashes(list(prefix), salt, lora)
            assert b.block_hash == chain[-1]
            # Prefix-closed: holders hold their whole prefix and reverse-order free puts a
            # parent behind its child, so no parent is evicted before its last child.
            assert len(chain) == 1 or pool.get_cached_block(chain[-2]) is not None
            rec = records[to_external(b.block_hash, self.form)]  # type: ignore[arg-type]
            parent = to_external(chain[-2], self.form) if len(chain) > 1 else None  # type: ignore[arg-type]
            assert rec.parent == parent
            assert rec.token_ids == list(prefix[-B:])
            assert rec.stored_by.lora_name == lora
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == self.queue
        assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (self.queries, self.hits)
        assert set(mgr.req_to_blocks) == set(self.live)
        holders: Counter[int] = Counter()
        for rid, req in self.live.items():
            table = mgr.req_to_blocks[rid]
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids)
            holders.update(ids)
            assert len(table) == -(-req.num_computed_tokens // B)
            n_cached = mgr.num_cached_block.get(rid, 0)
            assert n_cached == req.num_computed_tokens // B
            assert [b.block_hash for b in table[:n_cached]] == mgr.block_hashes(req)[:n_cached]
        for b in pool.blocks:
            assert b.ref_cnt == holders[b.block_id]
        assert mgr.usage == pytest.approx(len(holders) / pool.num_blocks)


_tail = st.lists(st.integers(0, 2), max_size=10)
_salt = st.sampled_from([None, "s1"])
_lora = st.sampled_from([None, "L"])


class PoolMachine(RuleBasedStateMachine):
    """Hypothesis drives :class:`PoolModel`; it shrinks a failure to a short op sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.m: PoolModel | None = None

    @initialize(num_blocks=st.integers(1, 12), form=st.sampled_from(["bytes", "int"]))
    def setup(self, num_blocks: int, form: str) -> None:
        self.m = PoolModel(num_blocks, form)

    @rule(system=st.integers(0, 2), tail=_tail, salt=_salt, lora=_lora, chunk=st.integers(1, 16))
    def admit(self, system: int, tail: list[int], salt, lora, chunk: int) -> None:
        self.m.admit(SYSTEM_PROMPTS[system] + tail or [0], salt, lora, chunk)

    @rule(i=st.integers(0, 63), chunk=st.integers(1, 16))
    def admit_again(self, i: int, chunk: int) -> None:
        self.m.admit_again(i, chunk)

    @rule(i=st.integers(0, 63), chunk=st.integers(1, 8), tok=st.integers(0, 2))
    def step(self, i: int, chunk: int, tok: int) -> None:
        self.m.step(i, chunk, tok)

    @rule(i=st.integers(0, 63))
    def finish(self, i: int) -> None:
        self.m.finish(i)

    @rule(i=st.integers(0, 63), chunk=st.integers(1, 16))
    def preempt_and_resume(self, i: int, chunk: int) -> None:
        self.m.preempt_and_resume(i, chunk)

    @rule()
    def reset(self) -> None:
        self.m.reset()

    @invariant()
    def consistent(self) -> None:
        if self.m is not None:
            self.m.check()
            for what, n in self.m.seen.items():
                if n:
                    event(what)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_random_op_sequences_keep_invariants_and_replay_exactly() -> None:
    """Long weighted sequences (rare resets), where hypothesis' runs are short and uniform;
    and a check that the interesting cases really happened."""
    import random

    total: Counter[str] = Counter()
    for seed in range(40):
        rng = random.Random(seed)
        m = PoolModel(rng.randint(2, 16), rng.choice(["bytes", "int"]))
        for _ in range(300):
            r = rng.random()
            i, chunk = rng.randrange(64), rng.randint(1, 12)
            if r < 0.30:
                tail = [rng.randint(0, 2) for _ in range(rng.randint(0, 10))]
                prompt = rng.choice(SYSTEM_PROMPTS) + tail or [0]
                m.admit(prompt, rng.choice([None, "s1"]), rng.choice([None, "L"]), chunk)
            elif r < 0.45:
                m.admit_again(i, chunk)
            elif r < 0.80:
                m.step(i, chunk, rng.randint(0, 2))
            elif r < 0.92:
                m.finish(i)
            elif r < 0.97:
                m.preempt_and_resume(i, chunk)
            else:
                m.reset()
            m.check()
        total += m.seen
    for what in ("hit", "out of blocks", "BlockRemoved", "duplicate copies", "reset True"):
        assert total[what] > 10, (what, total)
