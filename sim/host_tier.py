"""A host-memory KV tier for the simulator's replicas: blocks evicted from the device live
on in host memory, and a prefix found there is loaded back instead of recomputed.

Why in the simulator, and why this shape: a fleet's hit rate is bounded by what its caches
hold; a host tier several times the device's keeps the long contexts of conversations and
agents that no longer fit, and the router must know a host copy costs a load, not nothing
(:mod:`kvroute.router.routing.index_tiers`). What is modelled is what routing sees and pays:

- capacity: ``host_blocks`` hashes in an LRU (no data moves in a simulation);
- the copy: a block whose last device copy is evicted (its slot reused, the engine's lazy
  LRU) is copied to the host tier if it is not there already, and touched if it is; the
  LRU's victim is dropped. Each copy and drop is a ``BlockStored`` / ``BlockRemoved`` with
  ``medium="CPU"``, shaped as vLLM's offloading placeholders (one hash, no tokens), so the
  index is fed as a vLLM fleet with offloading would feed it;
- the load: a request's lookup walks its hash chain through the device cache, then on
  through the host tier (:meth:`TieredKVCacheManager.get_computed_blocks`); the host blocks
  count as computed, and at admission they get device blocks, cached under their hashes
  (device ``BlockStored``), as a finished load leaves them;
- the time: the blocks loaded and copied in a step (:meth:`TieredKVCacheManager.take_copies`)
  cost their bytes over the host link, which the replica adds to the step
  (``CostModel.step_time``'s ``transfer_s``: the copies overlap the step's compute and
  bound it from below).

The engine's scheduler drives this manager unchanged: a lookup followed at once by the
allocation of the same request, nothing in between that could evict the host blocks found
(the allocation itself moves them to the LRU's young end first).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from kvroute.events import MEDIUM_CPU, BlockHasher, BlockRemoved, BlockStored, KVCacheEvent
from kvroute.events.hashing import to_external
from kvroute.replica.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from kvroute.replica.core.kv_cache_manager import CacheRequest, KVCacheManager


class _EvictingPool(BlockPool):
    """The engine's pool, telling its manager about each hash whose last copy it evicts."""

    def __init__(self, num_blocks: int, on_evict: _HostLRU) -> None:
        super().__init__(num_blocks)
        self._on_evict = on_evict

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> BlockHash | None:
        h = super()._maybe_evict_cached_block(block)
        if h is not None and h not in self.cached_block_hash_to_block:
            self._on_evict.keep(h)
        return h


class _HostLRU:
    """The host tier's hashes, oldest first, and the events its changes publish."""

    def __init__(self, capacity: int, pool_form: str = "bytes") -> None:
        self.capacity = capacity
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()
        self.events: list[KVCacheEvent] = []
        self.form = pool_form
        self.stored = 0  # blocks copied in since the counter was last read

    def keep(self, h: BlockHash) -> None:
        """A block left the device: copy it in, or touch the copy already there."""
        lru = self.lru
        if h in lru:
            lru.move_to_end(h)
            return
        lru[h] = None
        self.stored += 1
        ext = to_external(h, self.form)  # type: ignore[arg-type]
        self.events.append(BlockStored([ext], None, [], 0, None, MEDIUM_CPU, None))
        if len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self.events.append(BlockRemoved([to_external(old, self.form)], MEDIUM_CPU))  # type: ignore[arg-type]


class TieredKVCacheManager(KVCacheManager):
    """The engine's KV cache manager over a device pool and a host tier (module docstring)."""

    def __init__(self, num_blocks: int, hasher: BlockHasher, host_blocks: int) -> None:
        if host_blocks < 1:
            raise ValueError("host_blocks must be >= 1 (a manager without a host tier is "
                             "the engine's KVCacheManager)")  # fmt: skip
        super().__init__(num_blocks, hasher)
        self.host = _HostLRU(host_blocks, self.block_pool.hash_form)
        self.block_pool = _EvictingPool(num_blocks, self.host)  # fresh: nothing happened yet
        self.loaded_blocks = 0  # blocks loaded since the last take_copies
        self.host_hit_tokens = 0  # tokens loaded, over the manager's life

    def take_copies(self) -> tuple[int, int]:
        """(blocks loaded, blocks copied out) since the last call: one step's transfers."""
        out = self.loaded_blocks, self.host.stored
        self.loaded_blocks = self.host.stored = 0
        return out

    def _host_run(self, request: CacheRequest, start: int) -> int:
        """Blocks of the request's chain from ``start`` on that the host tier holds, up to
        the engine's limit of a hit (one token is always computed)."""
        if request.skip_reading_prefix_cache:
            return 0
        limit = max(len(request.all_token_ids) - 1, 0) // self.block_size
        lru, k = self.host.lru, 0
        for h in itertools.islice(self.block_hashes(request), start, limit):
            if h not in lru:
                break
            k += 1
        return k

    def get_computed_blocks(
        self, request: CacheRequest, count: bool = True
    ) -> tuple[list[KVCacheBlock], int]:
        """The device's cached blocks, and the tokens cached in both tiers: the device's,
        then the host's that follow them (loaded at allocation)."""
        blocks, n = super().get_computed_blocks(request, count=False)
        if self.enable_caching and self.host.lru:
            n += self._host_run(request, len(blocks)) * self.block_size
        if count:
            self.count_lookup(request, n)
        return blocks, n

    def peek_cached_tokens(self, request: CacheRequest) -> int:
        n = super().peek_cached_tokens(request)
        if self.enable_caching and self.host.lru:
            n += self._host_run(request, n // self.block_size) * self.block_size
        return n

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """As the engine's, after loading the host blocks a lookup found: device blocks for
        them, cached under their hashes (None, nothing changed, if the device is short)."""
        hit = list(new_computed_blocks or ())
        bs = self.block_size
        k = num_new_computed_tokens // bs - len(hit)
        if k > 0:
            table = self._load(request, hit, k, num_new_tokens)
            if table is None:
                return None
            hit = table
        return super().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, hit, delay_cache_blocks
        )

    def _load(
        self, request: CacheRequest, hit: list[KVCacheBlock], k: int, num_new_tokens: int
    ) -> list[KVCacheBlock] | None:
        bs, pool = self.block_size, self.block_pool
        start = len(hit)
        hashes = self.block_hashes(request)
        wanted = hashes[start : start + k]
        lru = self.host.lru
        if request.num_computed_tokens or self.req_to_blocks.get(request.request_id):
            raise ValueError("host blocks load into a request's first allocation only")
        if any(h not in lru for h in wanted):  # the scheduler looks up, then allocates
            raise ValueError("a host block was dropped between lookup and allocation")
        total = (start + k) * bs + num_new_tokens
        evictable = sum(1 for b in hit if b.ref_cnt == 0)
        if -(-total // bs) - start > pool.get_num_free_blocks() - evictable:
            return None  # what the engine's allocate_slots would refuse
        for h in wanted:  # the young end: the evictions below push out older ones first
            lru.move_to_end(h)
        pool.touch(hit)  # held, so the next line cannot evict them
        table = hit + pool.get_new_blocks(k)
        pool.cache_full_blocks(
            table, hashes, start, start + k, bs, request.all_token_ids,
            lora_name=request.lora_name,
        )  # fmt: skip
        pool.free_blocks(reversed(table))  # cached and unheld, as the allocation expects
        self.loaded_blocks += k
        self.host_hit_tokens += k * bs
        if getattr(request, "num_cached_tokens", 0) < 0:  # its first admission: a hit
            request.host_hit = k * bs  # type: ignore[attr-defined]
        return table

    def reset_prefix_cache(self) -> bool:
        """The engine's reset forgets the host tier too (``AllBlocksCleared`` says so)."""
        ok = super().reset_prefix_cache()
        if ok:  # its copies' events, queued behind the pool's clear, would bring them back
            self.host.lru.clear()
            self.host.events.clear()
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        events = super().take_events()
        if self.host.events:
            events += self.host.events
            self.host.events = []
        return events
