"""One replica's holdings in the prefix index.

Split out of :mod:`.index` (the data structure and its invariants, which this obeys): the
per-replica record (:class:`Holdings`: its bit, its stored blocks as an LRU of stamps, its
copies, its predictions, its counters). Events write it; a match never reads it.
"""

from __future__ import annotations

from kvroute.events import ExternalBlockHash as Hash

__all__ = ["Holdings"]


class Holdings:
    """One replica's holdings, in plain dicts the garbage collector leaves alone."""

    __slots__ = (
        "bit",
        "blocks",
        "copies",
        "evicted",
        "low",
        "order",
        "predicted",
        "tick",
        "unknown_removals",
    )

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.blocks: dict[Hash, int] = {}  # hash -> LRU stamp of its last touch
        self.order: dict[int, Hash] = {}  # live stamp -> hash: the LRU order
        self.copies: dict[Hash, int] = {}  # hash -> copies, only where more than 1
        self.tick = 0  # the next stamp
        self.low = 0  # no live stamp is below it
        self.predicted: dict[Hash, float] = {}  # hash -> expiry
        self.evicted = 0  # entries forgotten by the memory bound
        self.unknown_removals = 0  # removes of hashes the index did not hold
