"""Token-id indexing: an engine's KV events re-hashed with the fleet's own block hash.

Why: a router can index an engine's events by their hashes only if it computes the same
hashes for requests. vLLM's default ``--prefix-caching-hash-algo sha256`` hashes a Python
pickle (and its ``xxhash`` ones take a random seed per process), so nothing outside that
process reproduces them. Every ``BlockStored`` still carries what the hash was made of --
its blocks' ``token_ids``, its ``parent_block_hash`` and per block its ``extra_keys`` -- so
a subscriber can hash those itself, with the fleet's :class:`~.hashing.BlockHasher`, and
index the result: the router's request hashes then match (Dynamo's router does the same).

How extra keys become kvroute's: vLLM 0.32 hashes its extra keys tagged by source (LoRA
``("lora", name, path)`` on every block, then multimodal keys, then ``("cache_salt",
salt)`` on block 0 only) and publishes them untagged per block (``[name, ..., salt]``).
kvroute's router passes a request's salt (its tenant's, see ``router/fleet/tenants.py``) to the
engine as vLLM's ``cache_salt`` and hashes the request with that salt on block 0 and the
LoRA name on every block. So a block whose untagged keys are, after the event's
``lora_name`` when set, either nothing or (on the chain's block 0) one string is hashed as
kvroute hashes a request: ``cache_salt`` = that string, ``lora_name`` = the event's. Any
other keys (multimodal, prompt embeddings) are folded, per block, into a LoRA-name slot
that starts with ``\\x00`` -- a value no router salt or adapter name takes -- so those
blocks are indexed consistently and never match a text request they differ from.

Invariants (one :class:`EventTranslator` per replica, all state under its lock):

- ``_map[e]`` is the fleet digest of engine hash ``e``, for every engine hash stored and not
  removed since the last clear, less what the bound forgot. ``_copies[e]`` is its count of
  stored copies where above 1. So the translated stream stores and removes each fleet
  hash exactly as often as the engine stored and removed the engine hashes that map to it,
  and an index fed the translated stream holds what an index of kvroute-hashed events of
  the same cache would (counts per hash included).
- A ``BlockRemoved`` of an engine hash not in ``_map`` is counted (``unknown_removals``) and
  dropped: it was stored before this subscriber listened, or forgotten by the bound.
- A ``BlockStored`` whose parent is not in ``_map`` cannot be hashed (the chain needs the
  parent's fleet digest): outside a snapshot it is dropped and counted (``unknown_parents``);
  its blocks are then missing from the index (fewer hits, never wrong ones). Inside a
  snapshot (whose events need not come parent first) it waits among ``_orphans`` until its
  parent is stored; what still waits when the snapshot ends is dropped and counted.
- Bound: at most ``max_entries`` engine hashes (least recently stored forgotten first); a
  forgotten entry is emitted as removals of its fleet hash, one per copy, so the index
  forgets it too and stays an under-approximation of the engine's cache.
- ``AllBlocksCleared`` (an engine reset, a restart, a snapshot's start) empties the map and
  passes through; so does :meth:`clear` (the front door dropped the replica).
- Tiers: ``_copies`` counts copies in every tier; ``_lower[(tier, e)]`` those in each lower
  tier (:func:`~.wire.tier_name`), so the device's are the difference. A remove is translated
  only against a copy of its own tier: a lower-tier placeholder (vLLM's offloading events
  without tokens, dropped as untranslatable) whose remove names a hash the device holds
  must not take the device's copy away, or the device's own remove would later find nothing
  and the index would keep a block the engine dropped.
- Events whose ``block_size`` is not the fleet's are dropped and counted (``untranslatable``):
  the router never hashes such blocks (vLLM's optional partial-block events).

Output hashes are in the fleet's external form (``to_external``); the map keeps the full
digest, which chaining needs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .hashing import ALGOS, BlockHasher, HashForm, to_external
from .wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    tier_name,
)

VLLM_REPRODUCED = {"sha256_cbor": "sha256_cbor_tagged"}  # vLLM 0.32's name -> kvroute's
TOKEN_INDEX_ALGO = "xxh3_128"  # the fleet's hash when no replica's can be reproduced
_OPAQUE = "\x00"  # starts a LoRA slot that holds extra keys kvroute does not model
_json = msgspec.json.Encoder()


def reproducible(algo: str) -> bool:
    """Whether kvroute computes this hash algorithm itself (else: index by token ids)."""
    return algo in ALGOS


def from_vllm_hash_algo(name: str) -> str:
    """What a replica reports for vLLM's ``--prefix-caching-hash-algo NAME``: kvroute's name
    when kvroute reproduces it, else ``vllm:NAME`` (indexed by token ids)."""
    return VLLM_REPRODUCED.get(name, f"vllm:{name}")


@dataclass(slots=True)
class TranslateStats:
    """Blocks seen and dropped, for /fleet. All counts are blocks, not events."""

    stored: int = 0  # blocks translated into stores
    removed: int = 0  # blocks translated into removes
    unknown_removals: int = 0  # removes of engine hashes not in the map
    unknown_parents: int = 0  # blocks dropped: their parent is not in the map
    untranslatable: int = 0  # blocks dropped: not the fleet's block size
    forgotten: int = 0  # map entries dropped by the bound
    conflicts: int = 0  # an engine hash re-stored with other contents (kept the first)


class EventTranslator:
    """One replica's engine hashes -> the fleet's, and its batches translated."""

    def __init__(
        self, hasher: BlockHasher, form: HashForm = "bytes", max_entries: int = 1_000_000
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.hasher = hasher
        self.form: HashForm = form
        self.max_entries = max_entries
        self.stats = TranslateStats()
        self._lock = threading.Lock()
        self._map: dict[ExternalBlockHash, bytes] = {}
        self._copies: dict[ExternalBlockHash, int] = {}
        self._lower: dict[tuple[str, ExternalBlockHash], int] = {}  # (tier, e) -> copies
        self._lower_tiers: dict[str, None] = {}  # lower tiers seen since the last reset
        self._orphans: dict[ExternalBlockHash, list[BlockStored]] = {}
        self._orphan_blocks = 0

    def __len__(self) -> int:
        return len(self._map)

    def fleet_hash(self, engine_hash: ExternalBlockHash) -> ExternalBlockHash | None:
        """The fleet's (external) hash for an engine hash it holds, or None."""
        d = self._map.get(engine_hash)
        return None if d is None else to_external(d, self.form)

    def clear(self) -> None:
        """Forget everything (the front door dropped what it knew of the replica)."""
        with self._lock:
            self._reset()

    def translate(self, batch: EventBatch, *, snapshot: bool = False) -> EventBatch:
        """The batch with fleet hashes. ``snapshot``: the batch is part of a snapshot, whose
        stores may name a parent stored later in it."""
        out: list[KVCacheEvent] = []
        with self._lock:
            if self._orphans and not snapshot:
                self._drop_orphans()
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    self._store(ev, out, snapshot)
                elif isinstance(ev, BlockRemoved):
                    self._remove(ev, out)
                elif isinstance(ev, AllBlocksCleared):
                    self._reset()
                    out.append(ev)
                else:  # pragma: no cover - decode_batch yields only the three kinds
                    raise TypeError(f"not a KV cache event: {type(ev).__name__}")
        return EventBatch(batch.ts, out, batch.data_parallel_rank)

    # -- under the lock ----------------------------------------------------------------------
    def _reset(self) -> None:
        self._map.clear()
        self._copies.clear()
        self._lower.clear()
        self._lower_tiers.clear()
        self._drop_orphans()

    def _drop_orphans(self) -> None:
        self.stats.unknown_parents += self._orphan_blocks
        self._orphans.clear()
        self._orphan_blocks = 0

    def _store(self, ev: BlockStored, out: list[KVCacheEvent], snapshot: bool) -> None:
        pending = [ev]
        while pending:
            ev = pending.pop()
            n = len(ev.block_hashes)
            if ev.block_size != self.hasher.block_size or len(ev.token_ids) != n * ev.block_size:
                self.stats.untranslatable += n
                continue
            engine_parent = ev.parent_block_hash
            parent = None if engine_parent is None else self._map.get(engine_parent)
            if engine_parent is not None and parent is None:
                if snapshot and self._orphan_blocks + n <= self.max_entries:
                    self._orphans.setdefault(engine_parent, []).append(ev)
                    self._orphan_blocks += n
                else:
                    self.stats.unknown_parents += n
                continue
            self._record(ev, parent, self._hash(ev, parent), out)
            if self._orphans:  # blocks of this event that waiting stores name as parent
                for e in ev.block_hashes:
                    waiting = self._orphans.pop(e, None)
                    if waiting:
                        self._orphan_blocks -= sum(len(w.block_hashes) for w in waiting)
                        pending.extend(waiting)

    def _record(
        self,
        ev: BlockStored,
        parent: bytes | None,
        digests: list[bytes],
        out: list[KVCacheEvent],
    ) -> None:
        """Maps each engine hash of ``ev`` (one more copy) and emits its translation, then
        what the bound forgets (after it: the bound may forget blocks of ``ev`` itself)."""
        mapping, copies, form = self._map, self._copies, self.form
        tier = _tier_of(ev)
        if tier != MEDIUM_GPU:
            lower = self._lower
            self._lower_tiers[tier] = None
            for e in ev.block_hashes:
                lower[tier, e] = lower.get((tier, e), 0) + 1
        hashes: list[ExternalBlockHash] = []
        for e, d in zip(ev.block_hashes, digests, strict=True):
            old = mapping.pop(e, None)  # re-inserted: the entry becomes the most recent
            if old is not None:
                copies[e] = copies.get(e, 1) + 1
                if old != d:
                    self.stats.conflicts += 1
                    d = old  # removes translate to the first: counts stay paired
            mapping[e] = d
            hashes.append(to_external(d, form))
        self.stats.stored += len(hashes)
        p = None if parent is None else to_external(parent, form)
        stored = BlockStored(
            hashes,
            p,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
            ev.lora_name,
            ev.extra_keys,
            ev.group_idx,
            ev.locality,
        )
        out.append(stored)
        if len(mapping) > self.max_entries:
            self._forget(len(mapping) - self.max_entries, out)

    def _forget(self, k: int, out: list[KVCacheEvent]) -> None:
        """Drops the ``k`` least recently stored entries; the index is told to drop them."""
        mapping, copies, form, lower = self._map, self._copies, self.form, self._lower
        gone: dict[str, list[ExternalBlockHash]] = {MEDIUM_GPU: []}  # tier -> removes
        for _ in range(k):
            e = next(iter(mapping))
            f = to_external(mapping.pop(e), form)
            left = copies.pop(e, 1)
            for tier in self._lower_tiers if lower else ():
                n = lower.pop((tier, e), 0)
                if n:
                    gone.setdefault(tier, []).extend([f] * n)
                    left -= n
            gone[MEDIUM_GPU].extend([f] * left)
        self.stats.forgotten += k
        out.extend(BlockRemoved(hs, tier) for tier, hs in gone.items() if hs)

    def _remove(self, ev: BlockRemoved, out: list[KVCacheEvent]) -> None:
        mapping, copies, form, lower = self._map, self._copies, self.form, self._lower
        tier = _tier_of(ev)
        hashes: list[ExternalBlockHash] = []
        for e in ev.block_hashes:
            d = mapping.get(e)
            if d is not None and (lower or tier != MEDIUM_GPU) and not self._take(tier, e):
                d = None  # no copy of its own tier: see the module docstring
            if d is None:
                self.stats.unknown_removals += 1
                continue
            c = copies.pop(e, 1)
            if c > 2:
                copies[e] = c - 1
            elif c == 1:
                del mapping[e]
            hashes.append(to_external(d, form))
        if hashes:
            self.stats.removed += len(hashes)
            out.append(BlockRemoved(hashes, ev.medium, ev.group_idx, ev.locality))

    def _take(self, tier: str, e: ExternalBlockHash) -> bool:
        """Whether a copy of ``e`` in ``tier`` is mapped; counts a lower tier's one out."""
        lower = self._lower
        if tier != MEDIUM_GPU:
            n = lower.get((tier, e), 0)
            if n > 1:
                lower[tier, e] = n - 1
            elif n:
                del lower[tier, e]
            return n > 0
        held = sum(lower.get((t, e), 0) for t in self._lower_tiers)
        return self._copies.get(e, 1) > held

    def _hash(self, ev: BlockStored, parent: bytes | None) -> list[bytes]:
        """The fleet digests of ``ev``'s blocks (module docstring: how extra keys map)."""
        hasher, tokens, lora = self.hasher, ev.token_ids, ev.lora_name
        keys = ev.extra_keys or ()
        salt: str | None = None
        odd: dict[int, str] = {}  # block -> its opaque LoRA slot
        for i, k in enumerate(keys):
            rest = _unmodelled(k, lora)
            if not rest:
                continue
            if i == 0 and parent is None and len(rest) == 1 and isinstance(rest[0], str):
                salt = rest[0]  # the chain's block 0: the request's cache_salt
            else:
                odd[i] = _OPAQUE + _json.encode([lora, rest]).decode()
        # A LoRA path is not in events; "" keeps sha256_cbor_tagged from refusing.
        if not odd:
            start = 0 if parent is None else 1
            return hasher.hash_blocks(
                tokens, cache_salt=salt, lora_name=lora, parent=parent, start_block=start,
                lora_path="",
            )  # fmt: skip
        bs, out, h = hasher.block_size, [], parent
        for i in range(len(ev.block_hashes)):
            (h,) = hasher.hash_blocks(
                tokens[i * bs : (i + 1) * bs],
                cache_salt=salt if i == 0 else None,
                lora_name=odd.get(i, lora),
                parent=h,
                start_block=0 if h is None else 1,
                lora_path="",
            )
            out.append(h)
        return out


def _tier_of(ev: BlockStored | BlockRemoved) -> str:
    medium = ev.medium
    if (medium is None or medium == MEDIUM_GPU) and ev.locality is None:
        return MEDIUM_GPU
    return tier_name(medium, ev.locality)


def _unmodelled(keys: Sequence[Any] | None, lora: str | None) -> list[Any]:
    """A block's untagged extra keys less the LoRA name vLLM puts first."""
    if not keys:
        return []
    rest = list(keys)
    if lora is not None and rest and rest[0] == lora:
        del rest[0]
    return rest
