"""Per-request KV bookkeeping over a :class:`BlockPool`: block tables, hash chains, hits.

Shaped after vLLM v1's ``KVCacheManager`` (full attention, one KV cache group). The
scheduler drives it, per request:

1. ``blocks, n = get_computed_blocks(req)`` -- the longest cached prefix (no side effect on
   the pool; updates the hit counters);
2. ``allocate_slots(req, num_new_tokens, n, blocks)`` -- touches the hit blocks, allocates
   slots for the tokens scheduled this step, and (unless ``delay_cache_blocks``) registers
   the blocks those tokens fill; ``None`` means "not enough free blocks", nothing changed;
3. later steps: ``allocate_slots(req, k)`` for the next chunk or decode token;
4. ``free(req)`` when it finishes, is aborted or is preempted (recompute resumes it by a
   fresh lookup, which usually hits its own freed blocks).

Registering at allocation time (vLLM's choice) lets a request scheduled in the same step hit
blocks whose KV this very step writes; that is only sound when the runner writes every
scheduled token's KV before any attention reads it (one batched forward pass, cache write
before attention in each layer). A runner that is not so should pass
``delay_cache_blocks=True`` and call :meth:`KVCacheManager.cache_blocks` after the step.

Invariants:
- ``req_to_blocks[r]`` holds distinct blocks; each block's ``ref_cnt`` equals the number of
  tables holding it;
- the first ``num_cached_block[r]`` blocks of a table carry the request's chained hashes
  ``req_to_block_hashes[r][i]``; the rest carry none (or are about to be cached);
- a hit covers at most ``num_tokens - 1`` tokens (so one forward pass always yields logits)
  and is block-aligned; for a fresh request ``num_tokens`` is its prompt length;
- driven only through this class, the set of cached hashes is prefix-closed (every cached
  hash's parent is cached too): a holder holds its whole prefix, and reverse-order free
  queues a parent behind its children. Events therefore never describe an orphan block.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvroute.events import MEDIUM_GPU, BlockHasher, KVCacheEvent
from kvroute.events.hashing import HashForm

from .block_pool import BlockHash, BlockPool, KVCacheBlock


class CacheRequest(Protocol):
    """What the manager reads from a scheduler's request (tokens only ever grow)."""

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...  # prompt, then output tokens
    @property
    def num_computed_tokens(self) -> int: ...  # before this step's scheduling
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def lora_name(self) -> str | None: ...
    @property
    def lora_path(self) -> str | None: ...  # sha256_cbor_tagged hashes it beside the name
    @property
    def skip_reading_prefix_cache(self) -> bool: ...  # computes every token (prompt logprobs)


class KVCacheManager:
    """Block tables of live requests and the prefix-cache walk, over one block pool."""

    def __init__(
        self,
        num_blocks: int,
        hasher: BlockHasher | None = None,
        *,
        enable_caching: bool = True,
        hash_form: HashForm = "bytes",
        medium: str = MEDIUM_GPU,
        enable_kv_cache_events: bool = True,
    ) -> None:
        self.hasher = hasher if hasher is not None else BlockHasher()
        self.block_size = self.hasher.block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_blocks,
            enable_caching=enable_caching,
            hash_form=hash_form,
            medium=medium,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept beside them: a step reads every running
        # request's table, and a copy of an int list costs less than a walk over blocks.
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_block: dict[str, int] = {}
        # In tokens, like vLLM's prefix_cache_queries / prefix_cache_hits. Every lookup
        # counts, so a request retried while waiting for blocks counts each time.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- hashing -----------------------------------------------------------------------
    def block_hashes(self, request: CacheRequest) -> list[BlockHash]:
        """The request's chained hashes of all its full blocks, extended incrementally."""
        rid = request.request_id
        hashes = self.req_to_block_hashes.setdefault(rid, [])
        tokens = request.all_token_ids
        bs = self.block_size
        num_full = len(tokens) // bs
        start = len(hashes)
        if num_full > start:
            hashes.extend(
                self.hasher.hash_blocks(
                    tokens[start * bs : num_full * bs],
                    cache_salt=request.cache_salt,
                    lora_name=request.lora_name,
                    parent=hashes[-1] if hashes else None,
                    start_block=start,
                    lora_path=request.lora_path,
                )
            )
        return hashes

    # -- the scheduler's calls ---------------------------------------------------------
    def get_computed_blocks(
        self, request: CacheRequest, count: bool = True
    ) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the request's longest cached prefix, and the tokens they hold.
        Counted in ``prefix_cache_queries`` / ``prefix_cache_hits`` unless ``count`` is False
        (then :meth:`count_lookup` counts it once the request is admitted); leaves the pool
        untouched."""
        if not self.enable_caching:
            return [], 0
        hit = self._cached_prefix(request)
        num_hit_tokens = len(hit) * self.block_size
        if count:
            self.count_lookup(request, num_hit_tokens)
        return hit, num_hit_tokens

    def count_lookup(self, request: CacheRequest, num_hit_tokens: int) -> None:
        """Counts one prefix lookup in the hit-rate counters."""
        if self.enable_caching:
            self.prefix_cache_queries += len(request.all_token_ids)
            self.prefix_cache_hits += num_hit_tokens

    def peek_cached_tokens(self, request: CacheRequest) -> int:
        """Tokens a lookup would hit now, without counting it: what a waiting request's
        prefill will save, for load reports."""
        if not self.enable_caching:
            return 0
        return len(self._cached_prefix(request)) * self.block_size

    def _cached_prefix(self, request: CacheRequest) -> list[KVCacheBlock]:
        """Walks the hash chain and stops at the first miss (block i+1's hash folds in block
        i's, so nothing past a miss can be a valid hit), over at most ``num_tokens - 1``
        tokens: one token is always computed, to get logits. Nothing for a request that must
        compute every token."""
        if request.skip_reading_prefix_cache:
            return []
        max_blocks = max(len(request.all_token_ids) - 1, 0) // self.block_size
        hit: list[KVCacheBlock] = []
        get = self.block_pool.get_cached_block
        for h in itertools.islice(self.block_hashes(request), max_blocks):
            block = get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Slots for ``num_new_tokens`` tokens after the computed ones; the new blocks.

        Returns None, changing nothing, when the pool cannot supply them. Hit blocks that
        sit in the free queue count against the free blocks, since touching removes them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        rid = request.request_id
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(rid, [])
        if req_blocks and not new_computed_blocks and not num_new_computed_tokens:
            # A running request's decode token or next chunk: often no new block at all.
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(req_blocks) * bs and total <= len(request.all_token_ids):
                fills_a_block = total // bs > self.num_cached_block.get(rid, 0)
                if fills_a_block and self.enable_caching and not delay_cache_blocks:
                    self.cache_blocks(request, total)
                return []
        hit = list(new_computed_blocks or ())
        if hit:
            if not self.enable_caching:
                raise ValueError("prefix-cache hits with caching disabled")
            if req_blocks or request.num_computed_tokens:
                raise ValueError(f"request {rid!r} already has blocks; hits come first")
            hashes = self.block_hashes(request)
            if any(b.block_hash != hashes[i] for i, b in enumerate(hit)):
                raise ValueError("a hit block was evicted between lookup and allocation")
        if num_new_computed_tokens != len(hit) * bs:
            raise ValueError("num_new_computed_tokens must be len(new_computed_blocks) * B")
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if total > len(request.all_token_ids):
            raise ValueError(f"{total} tokens scheduled, request {rid!r} has fewer")

        num_new_blocks = max(-(-total // bs) - len(req_blocks) - len(hit), 0)
        pool = self.block_pool
        if num_new_blocks > pool.get_num_free_blocks() - _num_evictable(hit):
            return None

        req_blocks = self.req_to_blocks.setdefault(rid, req_blocks)
        block_ids = self.req_to_block_ids.setdefault(rid, [])
        if hit:
            pool.touch(hit)
            req_blocks.extend(hit)
            block_ids.extend(b.block_id for b in hit)
            self.num_cached_block[rid] = len(hit)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        block_ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, total)
        return new_blocks

    def can_allocate(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        """Whether :meth:`allocate_slots` would find the blocks for these tokens now, without
        allocating them (a scheduler's look-ahead)."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        bs = self.block_size
        total = request.num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens
        num_new_blocks = -(-total // bs) - held - len(new_computed_blocks)
        free = self.block_pool.get_num_free_blocks() - _num_evictable(new_computed_blocks)
        return num_new_blocks <= free

    def num_noop_steps(self, requests: Iterable[CacheRequest]) -> int:
        """How many steps each of ``requests`` can be given one more token, one per step,
        with :meth:`allocate_slots` doing nothing: no block allocated, none filled (so none
        cached, no event). A run of that many decode steps leaves this manager as it is,
        which is what lets a simulator advance such a run in one go."""
        bs, caching = self.block_size, self.enable_caching
        tables, num_cached = self.req_to_blocks, self.num_cached_block
        steps = 1 << 62
        for req in requests:
            rid, p = req.request_id, req.num_computed_tokens
            room = len(tables.get(rid, ())) * bs - p  # slots held beyond p
            if caching:
                full = p // bs
                if num_cached.get(rid, 0) < full:
                    return 0  # a full block is still to be cached: the next call caches it
                room = min(room, (full + 1) * bs - 1 - p)  # stop before the filling token
            if room < steps:
                if room <= 0:
                    return 0
                steps = room
        return steps

    def cache_blocks(self, request: CacheRequest, num_computed_tokens: int) -> None:
        """Registers the request's blocks filled by its first ``num_computed_tokens`` tokens."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_computed_tokens, len(request.all_token_ids)) // self.block_size
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[rid],
            self.block_hashes(request),
            num_cached,
            num_full,
            self.block_size,
            request.all_token_ids,
            lora_name=request.lora_name,
        )
        self.num_cached_block[rid] = num_full

    def free(self, request: CacheRequest) -> None:
        """Releases the request's blocks, tail first; safe for a request holding none."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.req_to_block_ids.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        self.req_to_block_hashes.pop(rid, None)
        self.block_pool.free_blocks(reversed(blocks))

    # -- pass-throughs -----------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids (a copy: the table grows as it runs)."""
        return list(self.req_to_block_ids.get(request_id, ()))

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    @property
    def usage(self) -> float:
        return self.block_pool.usage


def _num_evictable(hit: Sequence[KVCacheBlock]) -> int:
    """Hit blocks in the free queue: touching them takes them out of it, so they count
    against the free blocks."""
    return sum(1 for b in hit if b.ref_cnt == 0)
