"""The engine's KV block pool: physical blocks, the free queue, the hash map, and KV events.

Shaped after vLLM v1's ``BlockPool`` (naming, lazy-LRU policy, events) with nano-vllm's
economy. Per-request bookkeeping (block tables, hit lookup) lives in
:mod:`kvroute.replica.core.kv_cache_manager`; this module knows blocks, not requests.

Policy ("lazy LRU"): a block whose refcount drops to 0 goes to the TAIL of the free queue
but keeps its hash and stays findable, so a later request can still hit it. Allocation pops
from the HEAD; only then, if the popped block still carries a hash, is that cache entry torn
down (and a ``BlockRemoved`` emitted). A hit on a free block "touches" it out of the middle
of the queue in O(1), which is why the queue is a hand-rolled doubly linked list.

Every block of ``range(num_blocks)`` is usable: no null block is reserved (kvroute has no
sliding-window layers that would need one; padding slots are the model runner's business).

Invariants (checked by :meth:`BlockPool.check_invariants`):
- a block is in the free queue  <=>  its ``ref_cnt == 0``; ``ref_cnt`` is never negative;
- the free queue is a consistent doubly linked list between two sentinels, each block at
  most once, and ``num_free_blocks`` is its length; blocks outside it have no links;
- ``block.block_hash is not None``  <=>  ``cached_block_hash_to_block[h][block.block_id] is
  block``; no hash maps to an empty dict; with caching disabled no block carries a hash;
- replaying every event this pool emitted, in order, from an empty
  :class:`kvroute.events.BlockSet` yields exactly :meth:`BlockPool.cached_hash_counts`
  (two physical copies of one hash count 2: the map is ``hash -> {block_id: block}``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvroute.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    to_external,
)
from kvroute.events.hashing import HashForm

if TYPE_CHECKING:
    from ..kv_tiers.tiers import KVTiers

BlockHash = bytes  # the internal form: the full digest from kvroute.events.BlockHasher


class KVCacheBlock:
    """One physical block of ``block_size`` KV slots in every layer."""

    __slots__ = ("block_hash", "block_id", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # number of live requests whose block table holds this block
        self.block_hash: BlockHash | None = None  # set while findable in the hash map
        # Links of the free queue; None while the block is not in it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:  # the links would make a default repr walk the whole queue
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: head = evicted next, tail = freed last.

    A doubly linked list through the blocks themselves (no node objects), between two
    sentinels so no operation needs a special case. Unlike ``collections.deque`` it removes
    a block from the middle in O(1), which every prefix hit on a free block needs.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        first = self.fake_head.next_free_block
        if first is None or first is self.fake_tail:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        last = self.fake_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail. O(n): for tests and debugging."""
        out: list[KVCacheBlock] = []
        cur = self.fake_head.next_free_block
        while cur is not None and cur is not self.fake_tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


class BlockPool:
    """All physical blocks of one engine, their reuse policy, and the events it implies."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        hash_form: HashForm = "bytes",
        medium: str = MEDIUM_GPU,
        enable_kv_cache_events: bool = True,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        to_external(b"\0" * 16, hash_form)  # rejects an unknown form up front
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_form: HashForm = hash_form
        self.medium = medium
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}: one hash may live in several physical copies.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self._events: list[KVCacheEvent] = []
        # Lower KV tiers (host, disk) that evicted blocks are copied down to: set by
        # KVTiers.attach; None (no tier) costs the hot path one test per call.
        self.tiers: KVTiers | None = None

    # -- lookup ------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any physical copy holding ``block_hash``, in use or free; None on a miss."""
        copies = self.cached_block_hash_to_block.get(block_hash)
        if not copies:
            return None
        return next(iter(copies.values()))

    # -- allocation and release --------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops ``num_blocks`` from the head of the free queue, evicting their old hashes.

        Eviction happens here and only here (lazily): all hashes evicted by one call travel
        in one ``BlockRemoved``, emitted before any store that uses the blocks.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: {self.free_block_queue.num_free_blocks} free"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        evicted: list[ExternalBlockHash] = []
        tiers = self.tiers
        down: list[tuple[int, BlockHash]] = []  # for the lower tiers: (block id, hash)
        for block in ret:
            if block.ref_cnt != 0:  # pragma: no cover - guarded by the queue invariant
                raise AssertionError(f"{block!r} in the free queue with ref_cnt != 0")
            h = self._maybe_evict_cached_block(block)
            if h is not None:
                evicted.append(to_external(h, self.hash_form))
                if tiers is not None:
                    down.append((block.block_id, h))
            block.ref_cnt = 1
        if evicted and self.enable_kv_cache_events:
            self._events.append(BlockRemoved(evicted, self.medium))
        if down:  # before the caller writes the blocks: their bytes are still the old ones
            assert tiers is not None
            tiers.offload(down)
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> BlockHash | None:
        """Drops ``block`` from the hash map; returns the hash it carried, if any."""
        h = block.block_hash
        if h is None:
            return None
        copies = self.cached_block_hash_to_block[h]
        del copies[block.block_id]
        if not copies:
            del self.cached_block_hash_to_block[h]
        block.block_hash = None
        return h

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: one more holder; a free block is pulled out of the queue first."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One holder fewer each; blocks reaching 0 join the tail in the order given.

        Callers pass a request's block table reversed, so its unique tail reaches the head
        (evicted first) before its shared root does.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # -- caching -----------------------------------------------------------------------
    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        token_ids: Sequence[int],
        lora_name: str | None = None,
    ) -> None:
        """Makes ``blocks[num_cached_blocks:num_full_blocks]`` findable by hash.

        ``blocks`` is a request's block table, ``block_hashes`` its hash chain and
        ``token_ids`` its tokens; the leading ``num_cached_blocks`` are already cached.
        Emits one ``BlockStored`` for the new blocks, in chain order.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if len(blocks) < num_full_blocks or len(block_hashes) < num_full_blocks:
            raise ValueError("fewer blocks or hashes than num_full_blocks")
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        for block in new_blocks:
            if block.block_hash is not None:
                raise ValueError(f"{block!r} is cached already")
        for block, h in zip(new_blocks, new_hashes, strict=True):
            block.block_hash = h
            self.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block
        parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
        if self.tiers is not None:
            self.tiers.on_cached(
                new_hashes,
                parent,
                token_ids[num_cached_blocks * block_size : num_full_blocks * block_size],
                block_size,
                lora_name,
            )
        if not self.enable_kv_cache_events:
            return
        form = self.hash_form
        self._events.append(
            BlockStored(
                block_hashes=[to_external(h, form) for h in new_hashes],
                parent_block_hash=to_external(parent, form) if parent is not None else None,
                token_ids=[
                    int(t)
                    for t in token_ids[
                        num_cached_blocks * block_size : num_full_blocks * block_size
                    ]
                ],
                block_size=block_size,
                lora_id=None,
                medium=self.medium,
                lora_name=lora_name,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        if self.tiers is not None:
            self.tiers.clear()  # the event clears every tier of this replica
        return True

    def emit(self, event: KVCacheEvent) -> None:
        """An event of a lower tier, in order with the pool's own (see kv_tiers)."""
        if self.enable_kv_cache_events:
            self._events.append(event)

    # -- observation -------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call, oldest first (the engine sends them once per step)."""
        events, self._events = self._events, []
        return events

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks some live request holds (ref_cnt > 0)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def cached_hash_counts(self) -> dict[ExternalBlockHash, int]:
        """External hash -> physical copies: what a subscriber's BlockSet should hold."""
        out: dict[ExternalBlockHash, int] = {}
        for h, copies in self.cached_block_hash_to_block.items():
            key = to_external(h, self.hash_form)
            out[key] = out.get(key, 0) + len(copies)
        return out

    def check_invariants(self) -> None:
        """Raises AssertionError on any broken invariant of the module docstring. O(n)."""

        def fail(msg: str) -> None:
            raise AssertionError(msg)

        q = self.free_block_queue
        seen: set[int] = set()
        prev, cur = q.fake_head, q.fake_head.next_free_block
        while cur is not q.fake_tail:
            if cur is None or cur.prev_free_block is not prev:
                fail(f"free queue broken after {prev!r}")
            assert cur is not None
            if cur.block_id in seen:
                fail(f"{cur!r} twice in the free queue")
            seen.add(cur.block_id)
            prev, cur = cur, cur.next_free_block
        if q.fake_tail.prev_free_block is not prev:
            fail("free queue tail sentinel broken")
        if len(seen) != q.num_free_blocks:
            fail(f"num_free_blocks {q.num_free_blocks} != queue length {len(seen)}")
        for b in self.blocks:
            if b.ref_cnt < 0:
                fail(f"{b!r} has a negative ref_cnt")
            if (b.ref_cnt == 0) != (b.block_id in seen):
                fail(f"{b!r}: in free queue is {b.block_id in seen}")
            if b.block_id not in seen and (b.prev_free_block or b.next_free_block):
                fail(f"{b!r} is linked but not in the free queue")
            if b.block_hash is not None:
                if not self.enable_caching:
                    fail(f"{b!r} carries a hash with caching disabled")
                copies = self.cached_block_hash_to_block.get(b.block_hash, {})
                if copies.get(b.block_id) is not b:
                    fail(f"{b!r} carries a hash but is not findable by it")
        for h, copies in self.cached_block_hash_to_block.items():
            if not copies:
                fail(f"hash {h.hex()} maps to no block")
            for bid, b in copies.items():
                if b is not self.blocks[bid] or b.block_hash != h:
                    fail(f"map entry {h.hex()}/{bid} points to {b!r}")
