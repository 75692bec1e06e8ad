"""Read-only views of the prefix index: sizes, per-replica counts, exports, the invariants check.

A mixin of :class:`~.index.PrefixIndex`, split out of :mod:`.index` so that file holds the
data structure itself (its maps, how events and predictions change them, the match walk)
and its invariants docstring; these methods only read it, under its lock, for the front
door's metrics and ``/fleet``, for tests and for debugging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvroute.events import MEDIUM_GPU
from kvroute.events import ExternalBlockHash as Hash

from .index_holdings import Holdings
from .index_tiers import MAX_TIERS, tier_rank
from .index_tree import Kids, Node, check_tree, export_node

if TYPE_CHECKING:
    from .index import PrefixIndex


class IndexViews:
    """:class:`~.index.PrefixIndex`'s inspection and metrics methods (its attributes)."""

    _lock: threading.Lock
    _clock: Callable[[], float]
    _masks: dict[Hash, int]
    _nodes: dict[Hash, Node]
    _pmasks: dict[Hash, int]
    _orphans: dict[Hash, Kids]
    _replicas: dict[str, Holdings]
    _tiers: dict[str, PrefixIndex]
    _tier_list: list[tuple[str, PrefixIndex]]
    max_blocks_per_replica: int

    if TYPE_CHECKING:  # the index's own

        def _expire(self, now: float) -> None: ...

    def __len__(self) -> int:
        """Distinct hashes indexed (predicted ones included)."""
        masks = self._masks
        return len(masks) + sum(1 for h in self._pmasks if h not in masks)

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)

    def num_blocks(self, replica_id: str, tier: str = MEDIUM_GPU) -> int:
        """Distinct hashes the replica holds per its events (predictions excluded), in
        ``tier`` (a :func:`~kvroute.events.tier_name`; the device's by default)."""
        index = self if tier == MEDIUM_GPU else self._tiers.get(tier)
        rep = index._replicas.get(replica_id) if index is not None else None
        return len(rep.blocks) if rep else 0

    def num_predicted(self, replica_id: str, now: float | None = None) -> int:
        with self._lock:
            self._expire(self._clock() if now is None else now)
            rep = self._replicas.get(replica_id)
            return len(rep.predicted) if rep else 0

    def counts(self, replica_id: str, tier: str = MEDIUM_GPU) -> dict[Hash, int]:
        """Hash -> copies held by the replica in ``tier`` (the device's by default), least
        recently touched first (a copy)."""
        with self._lock:
            index = self if tier == MEDIUM_GPU else self._tiers.get(tier)
            rep = index._replicas.get(replica_id) if index is not None else None
            return dict(index._lru(rep)) if rep and index else {}

    def _lru(self, rep: Holdings) -> list[tuple[Hash, int]]:
        """(hash, copies) of a replica's stored entries, least recently touched first."""
        order, copies = rep.order, rep.copies
        return [(h, copies.get(h, 1)) for h in map(order.__getitem__, sorted(order))]

    def export(self, replica_id: str) -> dict[str, Any]:
        """The replica's tree as JSON-ready data: bytes hashes as hex, int hashes as ints."""
        with self._lock:
            self._expire(self._clock())
            rep = self._replicas.get(replica_id)
            if rep is None:
                raise KeyError(replica_id)
            held = [*self._lru(rep), *((h, 0) for h in rep.predicted)]  # 0: predicted
            nodes = [export_node(self._nodes, h, copies) for h, copies in held]
            out: dict[str, Any] = {
                "replica_id": replica_id,
                "num_blocks": len(rep.blocks),
                "num_predicted": len(rep.predicted),
                "num_tokens": sum(d["tokens"] for d in nodes if d["copies"]),
                "evicted": rep.evicted,
                "unknown_removals": rep.unknown_removals  # every tier's
                + sum(
                    srep.unknown_removals
                    for _, sub in self._tier_list
                    if (srep := sub._replicas.get(replica_id)) is not None
                ),
                # blocks per lower tier: a load away, never device hits
                "tiers": {
                    t: len(srep.blocks)
                    for t, sub in self._tier_list
                    if (srep := sub._replicas.get(replica_id)) is not None
                },
            }
        nodes.sort(key=lambda d: (d["depth"] is None, d["depth"] or 0))
        out["nodes"] = nodes
        return out

    def check_invariants(self) -> None:
        """Asserts :mod:`.index`'s docstring invariants, in O(size): for tests and debugging."""
        with self._lock:
            want: dict[Hash, int] = {}
            pwant: dict[Hash, int] = {}
            for rep in self._replicas.values():
                assert not rep.blocks.keys() & rep.predicted.keys(), "stored and predicted"
                assert all(c >= 2 for c in rep.copies.values()), "copies below 2 kept"
                assert rep.copies.keys() <= rep.blocks.keys(), "copies of a hash not held"
                assert len(rep.blocks) <= self.max_blocks_per_replica, "bound exceeded"
                assert len(rep.order) == len(rep.blocks), "LRU order disagrees"
                for h, stamp in rep.blocks.items():
                    assert rep.order.get(stamp) == h, "LRU stamp not in order"
                    assert rep.low <= stamp < rep.tick, "LRU stamp out of range"
                for h in rep.blocks:
                    want[h] = want.get(h, 0) | rep.bit
                for h in rep.predicted:
                    pwant[h] = pwant.get(h, 0) | rep.bit
            assert self._masks == want and self._nodes.keys() == want.keys(), "masks disagree"
            assert self._pmasks == pwant, "prediction masks disagree"
            check_tree(self._nodes, self._orphans)
            assert len(self._tiers) <= MAX_TIERS and MEDIUM_GPU not in self._tiers
            assert [t for t, _ in self._tier_list] == sorted(self._tiers, key=tier_rank)
            for sub in self._tiers.values():
                assert not sub._pmasks and not sub._tiers, "a tier with predictions or tiers"
                for rid, srep in sub._replicas.items():
                    assert srep.bit == self._replicas[rid].bit, "a tier's bit differs"
        for sub in self._tiers.values():
            sub.check_invariants()
