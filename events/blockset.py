"""The block set an event stream implies: what one engine holds, rebuilt from its events.

The publisher keeps one (its snapshots are drawn from it, so a snapshot is exactly the
integral of the stream up to its ``seq``); tests and simple consumers keep one per replica.

Tiers: copies are kept per tier (:func:`~.wire.tier_name` of the event's ``medium``): the
device's in the main map, each lower tier's (host memory, disk) in its own. A block evicted
from the device while its host copy lives on is a remove in one tier and nothing in the
other, so a snapshot, drawn tier by tier, gives a subscriber every tier back.

Invariants:
- ``count(h, tier)`` is stores minus removes of ``h`` in that tier since the last clear,
  never below 0: an engine may hold two physical copies of one hash, and removing one must
  not hide the other; a remove in one tier never touches another's copies.
- a hash with count 0 is absent (not kept with a zero count); a tier with none is absent.
- ``AllBlocksCleared`` empties every tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

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


class StoredBlock(NamedTuple):
    """One hash's record. Immutable, so a shallow copy of the map is a consistent snapshot;
    it points into the event that stored the block, so recording a block costs no copy."""

    count: int
    parent: ExternalBlockHash | None
    stored_by: BlockStored  # the event that (last) stored this hash
    index: int  # position of this hash in ``stored_by.block_hashes``

    @property
    def token_ids(self) -> list[int]:
        bs = self.stored_by.block_size
        return self.stored_by.token_ids[self.index * bs : (self.index + 1) * bs]


class BlockSet:
    """Hash -> :class:`StoredBlock` per tier, maintained by applying events in stream order.
    Sizes, membership and iteration are the device tier's; ``tier`` arguments and
    :meth:`tier_records` reach the others."""

    def __init__(self) -> None:
        self._blocks: dict[ExternalBlockHash, StoredBlock] = {}  # the device tier
        self._tiers: dict[str, dict[ExternalBlockHash, StoredBlock]] = {}  # lower tiers
        self.unknown_removals = 0  # removes of hashes we never saw stored (in that tier)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def __iter__(self) -> Iterator[ExternalBlockHash]:
        return iter(self._blocks)

    def _tier(self, tier: str) -> dict[ExternalBlockHash, StoredBlock]:
        return self._blocks if tier == MEDIUM_GPU else self._tiers.get(tier, {})

    def count(self, h: ExternalBlockHash, tier: str = MEDIUM_GPU) -> int:
        rec = self._tier(tier).get(h)
        return rec.count if rec else 0

    def counts(self, tier: str = MEDIUM_GPU) -> dict[ExternalBlockHash, int]:
        """Hash -> copies in ``tier`` (a :func:`~.wire.tier_name`; the device by default)."""
        return {h: r.count for h, r in self._tier(tier).items()}

    def tiers(self) -> list[str]:
        """The lower tiers that hold something."""
        return list(self._tiers)

    def records(self) -> dict[ExternalBlockHash, StoredBlock]:
        """The device tier, a shallow copy: O(n) in C, safe to read while the set changes."""
        return self._blocks.copy()

    def tier_records(self) -> dict[str, dict[ExternalBlockHash, StoredBlock]]:
        """Each lower tier's records, shallow copies (as :meth:`records`)."""
        return {t: recs.copy() for t, recs in self._tiers.items()}

    def clear(self) -> None:
        self._blocks.clear()
        self._tiers.clear()

    def apply_batch(self, batch: EventBatch) -> None:
        for ev in batch.events:
            self.apply(ev)

    def apply(self, ev: KVCacheEvent) -> None:
        if isinstance(ev, (BlockStored, BlockRemoved)):
            medium, locality = ev.medium, ev.locality
            if (medium is None or medium == MEDIUM_GPU) and locality is None:
                blocks = self._blocks  # the usual event: no tier lookup
            else:
                tier = tier_name(medium, locality)
                blocks = self._blocks if tier == MEDIUM_GPU else self._tiers.get(tier)
                if blocks is None:
                    blocks = self._tiers[tier] = {}
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            get = blocks.get
            for i, h in enumerate(ev.block_hashes):
                rec = get(h)
                blocks[h] = StoredBlock(rec.count + 1 if rec else 1, parent, ev, i)
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                rec = blocks.get(h)
                if rec is None:
                    self.unknown_removals += 1
                elif rec.count == 1:
                    del blocks[h]
                else:
                    blocks[h] = rec._replace(count=rec.count - 1)
            if not blocks and blocks is not self._blocks:
                self._tiers.pop(tier_name(ev.medium, ev.locality), None)
        elif isinstance(ev, AllBlocksCleared):
            self.clear()
        else:  # pragma: no cover - decode_batch only yields the three kinds
            raise TypeError(f"not a KV cache event: {type(ev).__name__}")


def snapshot_events(*tiers: dict[ExternalBlockHash, StoredBlock]) -> list[BlockStored]:
    """One BlockStored per stored copy, so replaying them from empty reproduces the counts,
    for each tier's records given (:meth:`BlockSet.records`, then the values of
    :meth:`BlockSet.tier_records`): each event keeps the medium and locality of the event
    that stored its copy, so every tier comes back as it was.

    Each event holds a single block with its own parent: the snapshot need not be ordered
    parent-first for a consumer that links children to parents by hash.
    Each keeps its block's ``extra_keys`` (the cache salt on block 0): a subscriber that
    indexes by token ids hashes them (:mod:`.translate`).
    """
    out: list[BlockStored] = []
    for records in tiers:
        for h, r in records.items():
            src = r.stored_by
            keys = src.extra_keys
            extra = [keys[r.index]] if keys and r.index < len(keys) else None
            ev = BlockStored(
                [h], r.parent, r.token_ids, src.block_size, src.lora_id, src.medium,
                src.lora_name, extra, src.group_idx, src.locality,
            )  # fmt: skip
            out.extend([ev] * r.count)
    return out
