"""One engine prefix cache, told twice: as kvroute-hashed events and as a vLLM engine with
``--prefix-caching-hash-algo sha256`` tells it.

The vLLM side hashes as vLLM 0.32 does with ``sha256``: SHA-256 of a pickle of ``(parent,
tokens, extra)`` with extra keys tagged by source (``("cache_salt", salt)`` on block 0), sent
as the digest's low 64 bits; its events carry ``token_ids`` and the extra keys untagged, one
entry per block (``[salt]`` on block 0). Stores extend the longest held prefix (blocks after
a hole are stored again, as extra copies), evictions take any held copy, clears forget
everything. The kvroute side is the same operations under the fleet's own hash.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from collections import Counter
from collections.abc import Sequence

from kvroute.events import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockSet,
    BlockStored,
    KVCacheEvent,
    to_external,
)
from kvroute.events.hashing import HashForm

_NONE = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


def vllm_sha256_hashes(tokens: Sequence[int], block_size: int, salt: str | None) -> list[int]:
    """vLLM's ``sha256`` chain (pickle-based), in its int event form."""
    out, parent = [], _NONE
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        extra = (("cache_salt", salt),) if salt and i == 0 else None
        parent = hashlib.sha256(pickle.dumps((parent, block, extra), protocol=5)).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def reachable(engine: BlockSet, kv_of: dict) -> dict:
    """The kvroute hash and copies of each block the engine holds whose every ancestor it
    holds too: the blocks a request can hit (a lookup stops at the first miss)."""
    records, memo = engine.records(), {}

    def ok(h) -> bool:
        if h not in memo:
            r = records.get(h)
            memo[h] = r is not None and (r.parent is None or ok(r.parent))
        return memo[h]

    return {kv_of[h]: r.count for h, r in records.items() if ok(h)}


class TwinCache:
    """Each operation returns ``(kvroute events, vLLM events)`` of the same cache change."""

    def __init__(self, hasher: BlockHasher, form: HashForm, seed: int = 0) -> None:
        self.hasher, self.form = hasher, form
        self.rng = random.Random(seed)
        self.held: Counter[int] = Counter()  # vLLM hash -> copies held
        self.kv_of: dict[int, bytes] = {}  # vLLM hash -> kvroute digest (test-side truth)
        self.prompts: list[tuple[list[int], str | None]] = []

    def _ext(self, digest: bytes) -> object:
        return to_external(digest, self.form)

    def store(
        self, tokens: list[int], salt: str | None
    ) -> tuple[list[KVCacheEvent], list[KVCacheEvent]]:
        bs = self.hasher.block_size
        kv = self.hasher.hash_blocks(tokens, cache_salt=salt)
        vl = vllm_sha256_hashes(tokens, bs, salt)
        self.kv_of.update(zip(vl, kv, strict=True))
        start = next((i for i, h in enumerate(vl) if not self.held[h]), None)
        if start is None:  # all held: one more physical copy of a random block
            start = self.rng.randrange(len(vl))
            end = start + 1
        else:
            end = len(vl)
        n = end - start
        toks = tokens[start * bs : end * bs]
        extra = [[salt] if salt and start + j == 0 else None for j in range(n)]
        vllm_ev = BlockStored(
            vl[start:end], vl[start - 1] if start else None, toks, bs, None, "GPU", None, extra
        )
        kv_ev = BlockStored(
            [self._ext(d) for d in kv[start:end]],
            self._ext(kv[start - 1]) if start else None,
            toks,
            bs,
            None,
            "GPU",
            None,
        )
        self.held.update(vl[start:end])
        return [kv_ev], [vllm_ev]

    def evict(self, k: int) -> tuple[list[KVCacheEvent], list[KVCacheEvent]]:
        held = sorted(self.held)
        gone = self.rng.sample(held, min(k, len(held)))
        for h in gone:
            self.held[h] -= 1
            if not self.held[h]:
                del self.held[h]
        if not gone:
            return [], []
        kv = [BlockRemoved([self._ext(self.kv_of[h]) for h in gone], "GPU")]
        return kv, [BlockRemoved(gone, "GPU")]

    def clear(self) -> tuple[list[KVCacheEvent], list[KVCacheEvent]]:
        self.held.clear()
        return [AllBlocksCleared()], [AllBlocksCleared()]

    def step(self, salts: Sequence[str | None]) -> tuple[list[KVCacheEvent], list[KVCacheEvent]]:
        """A random operation: a new prompt, a prompt sharing an earlier one's prefix, an
        eviction, or (rarely) a clear."""
        r, bs, rng = self.rng.random(), self.hasher.block_size, self.rng
        if r < 0.02:
            return self.clear()
        if r < 0.35 or not self.prompts:
            tokens = [rng.randrange(1000) for _ in range(bs * rng.randint(1, 5))]
            salt = rng.choice(salts)
            self.prompts.append((tokens, salt))
            return self.store(tokens, salt)
        if r < 0.75:
            base, salt = rng.choice(self.prompts)
            keep = rng.randint(0, len(base) // bs) * bs
            tokens = base[:keep] + [rng.randrange(1000) for _ in range(bs * rng.randint(0, 3))]
            if len(tokens) < bs:
                tokens = base
            self.prompts.append((tokens, salt))
            return self.store(tokens, salt)
        return self.evict(rng.randint(1, 4))
