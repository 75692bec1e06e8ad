"""The block set an event stream implies: what one engine holds, rebuilt from its events.

The publisher keeps one (its snapshots are drawn from it, so a snapshot is exactly the
integral of the stream up to its ``seq``); tests and simple consumers keep one per replica.

Invariants:
- ``count(h)`` is stores minus removes of ``h`` since the last clear, never below 0: an
  engine may hold two physical copies of one hash, and removing one must not hide the other.
- a hash with count 0 is absent (not kept with a zero count).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from .wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
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
    """Hash -> :class:`StoredBlock`, maintained by applying events in stream order."""

    def __init__(self) -> None:
        self._blocks: dict[ExternalBlockHash, StoredBlock] = {}
        self.unknown_removals = 0  # removes of hashes we never saw stored

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def __iter__(self) -> Iterator[ExternalBlockHash]:
        return iter(self._blocks)

    def count(self, h: ExternalBlockHash) -> int:
        rec = self._blocks.get(h)
        return rec.count if rec else 0

    def counts(self) -> dict[ExternalBlockHash, int]:
        return {h: r.count for h, r in self._blocks.items()}

    def records(self) -> dict[ExternalBlockHash, StoredBlock]:
        """A shallow copy: O(n) in C, safe to read while the set keeps changing."""
        return self._blocks.copy()

    def clear(self) -> None:
        self._blocks.clear()

    def apply_batch(self, batch: EventBatch) -> None:
        for ev in batch.events:
            self.apply(ev)

    def apply(self, ev: KVCacheEvent) -> None:
        blocks = self._blocks
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
        elif isinstance(ev, AllBlocksCleared):
            blocks.clear()
        else:  # pragma: no cover - decode_batch only yields the three kinds
            raise TypeError(f"not a KV cache event: {type(ev).__name__}")


def snapshot_events(records: dict[ExternalBlockHash, StoredBlock]) -> list[BlockStored]:
    """One BlockStored per stored copy, so replaying them from empty reproduces the counts.

    Each event holds a single block with its own parent: the snapshot need not be ordered
    parent-first for a consumer that links children to parents by hash.
    Each keeps its block's ``extra_keys`` (the cache salt on block 0): a subscriber that
    indexes by token ids hashes them (:mod:`.translate`).
    """
    out: list[BlockStored] = []
    for h, r in records.items():
        src = r.stored_by
        keys = src.extra_keys
        extra = [keys[r.index]] if keys and r.index < len(keys) else None
        ev = BlockStored(
            [h], r.parent, r.token_ids, src.block_size, src.lora_id, src.medium, src.lora_name,
            extra, src.group_idx,
        )  # fmt: skip
        out.extend([ev] * r.count)
    return out
