"""What the block pool's tests share: a request stand-in, a manager of block size B, and
scheduling as the scheduler does it."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.events import BlockHasher
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
