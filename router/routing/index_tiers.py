"""Lower KV tiers in the prefix index: what a match reports beyond the device's copies.

A replica may keep blocks evicted from its device cache in host memory (``"CPU"``) or on
local disk (``"STORAGE"``), vLLM's offloading connector and kvroute's engine alike. Such a
copy saves the recompute of its tokens but costs a load, so it is not a device hit: the
policy prices it at its load time (:mod:`.policy`). The index keeps each lower tier's
copies apart from the device's, and a match says, per replica, how many leading blocks its
device holds and, beyond them, how many more it holds in a lower tier (per tier).

Why only beyond the device hit, and only in a lower tier: an engine reads its device cache
up to the first block it lacks, then asks its lower tiers for the blocks that follow
(vLLM's connector looks up from the device hit on); a block the device holds after a gap,
in no lower tier, is recomputed. So the extension is the run of blocks after the device hit
that some lower tier holds, each counted once, in the fastest tier that has it
(:func:`tier_rank`).

An unknown medium (not ``GPU``, ``CPU`` or ``STORAGE``: another system's name, or vLLM's
``REMOTE`` copies) is indexed as a lower tier of its own, so its stores and removes pair up
and it shows in exports, and is never a device hit. The policy credits it nothing unless
the replica reports a load bandwidth for that name: such a copy may live on shared or
remote storage, or in a store this engine cannot read for this request, and crediting a
copy that turns out to cost a recompute is the failure peers' users report most.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvroute.events import BlockRemoved, BlockStored
from kvroute.events import ExternalBlockHash as Hash
from kvroute.events.wire import LOWER_MEDIA

if TYPE_CHECKING:
    from .index import PrefixIndex

MAX_TIERS = 8  # distinct lower tiers indexed; blocks of further media are counted, not kept
_CHUNK = 256  # blocks applied per lock hold, as the device's


class TierMatch(NamedTuple):
    """One replica's match: ``device`` leading blocks in its device cache, then ``lower``:
    (tier, blocks) in the order the tiers are ranked, each block in its fastest tier."""

    device: int
    lower: tuple[tuple[str, int], ...] = ()

    @property
    def blocks(self) -> int:
        """Leading blocks held in any tier."""
        return self.device + sum(n for _, n in self.lower)


def tier_rank(tier: str) -> tuple[int, str]:
    """Sort key, fastest first: the known lower media in their order, then the others."""
    return (LOWER_MEDIA.index(tier), "") if tier in LOWER_MEDIA else (len(LOWER_MEDIA), tier)


def extend(
    hashes: Sequence[Hash],
    device: dict[str, int],
    bits: dict[str, int],
    tiers: Sequence[tuple[str, dict[Hash, int]]],
) -> dict[str, list[tuple[str, int]]]:
    """Per replica, the lower-tier extension of its device hit: (tier, blocks) pairs.

    ``device`` gives each replica's device hit (absent: 0), ``bits`` each replica's mask
    bit, ``tiers`` each lower tier's hash -> holders mask, fastest first. One walk over the
    blocks after the shortest device hit that starts an extension: per block one lookup
    per tier, whatever the number of replicas (their bits ride along in masks, and the
    counts are tallied per distinct mask of holders, which stays the same over runs).
    """
    total = len(hashes)
    if not total or not tiers:
        return {}
    maps = [m for _, m in tiers]

    def lower_mask(h: Hash) -> int:
        m = 0
        for t in maps:
            m |= t.get(h, 0)
        return m

    starts: dict[int, int] = {}  # position -> bits of the replicas whose extension starts there
    at_device = 0
    for rid, d in device.items():
        bit = bits.get(rid)
        if bit is None:
            continue
        at_device |= bit
        if d < total and lower_mask(hashes[d]) & bit:
            starts[d] = starts.get(d, 0) | bit
    first = lower_mask(hashes[0]) & ~at_device  # replicas with no device hit at all
    if first:
        starts[0] = starts.get(0, 0) | first
    if not starts:
        return {}
    tally: list[dict[int, int]] = [{} for _ in maps]  # per tier: holders mask -> blocks
    order = sorted(starts)
    if len(maps) == 1:
        _walk_one(hashes, maps[0], starts, order, tally[0])
        return _expand(tiers, tally, bits)
    k, active = 0, 0
    i = order[0]
    while i < total:
        if k < len(order) and order[k] == i:
            active |= starts[order[k]]
            k += 1
        if not active:
            if k == len(order):
                break
            i = order[k]  # nothing running: jump to the next start
            continue
        h, rest = hashes[i], active
        for t, m in enumerate(maps):
            held = m.get(h, 0) & rest
            if held:
                tally[t][held] = tally[t].get(held, 0) + 1
                rest &= ~held
                if not rest:
                    break
        active &= ~rest  # those that hold it in no lower tier stop here
        i += 1
    return _expand(tiers, tally, bits)


def _walk_one(
    hashes: Sequence[Hash],
    masks: dict[Hash, int],
    starts: dict[int, int],
    order: list[int],
    tally: dict[int, int],
) -> None:
    """:func:`extend`'s walk over one tier, the usual case (a host tier): its lookups in C,
    then a step per run of blocks with the same holders (masks are interned, and a chain's
    holders change at few places), not per block."""
    total = len(hashes)
    first = order[0]
    held = list(map(masks.get, hashes[first:], itertools.repeat(0)))
    ends = [*order[1:], total]
    active = 0
    for start, end in zip(order, ends, strict=True):
        active |= starts[start]
        if not active:
            continue
        for m, run in itertools.groupby(held[start - first : end - first]):
            active &= m  # those that do not hold it stop here
            if not active:
                break
            n = len(list(run))
            tally[active] = tally.get(active, 0) + n


def _expand(
    tiers: Sequence[tuple[str, dict[Hash, int]]],
    tally: list[dict[int, int]],
    bits: dict[str, int],
) -> dict[str, list[tuple[str, int]]]:
    """Per-mask tallies, per tier, spread over the replicas of each mask."""
    names = {bit: rid for rid, bit in bits.items()}
    out: dict[str, list[tuple[str, int]]] = {}
    for (tier, _), counts in zip(tiers, tally, strict=True):
        per: dict[str, int] = {}
        for mask, n in counts.items():
            while mask:
                low = mask & -mask
                rid = names[low]
                per[rid] = per.get(rid, 0) + n
                mask ^= low
        for rid, n in per.items():
            out.setdefault(rid, []).append((tier, n))
    return out


class LowerTiers:
    """:class:`~.index.PrefixIndex`'s methods for lower tiers (the index's docstring has
    their invariants): each tier a sub-index of the same class, created at its first store,
    fed and read under the parent's lock, its replicas under the parent's bits."""

    _lock: threading.Lock
    _tiers: dict[str, PrefixIndex]
    has_lower_tiers: bool
    _tier_list: list[tuple[str, PrefixIndex]]
    _replicas: dict[str, Any]
    _clock: Callable[[], float]
    max_lower_blocks_per_replica: int
    unindexed_tier_blocks: int

    if TYPE_CHECKING:  # the index's own

        def _replica(self, rid: str) -> Any: ...
        def _match(self, hashes: Sequence[Hash], now: float | None = None) -> dict[str, int]: ...

    def _apply_lower(
        self, rid: str, tier: str, ev: BlockStored | BlockRemoved, stored: bool
    ) -> None:
        """A lower tier's event, into that tier's sub-index."""
        hashes = ev.block_hashes
        for i in range(0, len(hashes), _CHUNK):
            with self._lock:
                sub = self._tiers.get(tier)
                if sub is None:
                    if not stored:  # a tier never stored to: nothing to remove
                        rep = self._replicas.get(rid)
                        if rep is not None:
                            rep.unknown_removals += len(hashes) - i
                        return
                    if len(self._tiers) >= MAX_TIERS:
                        self.unindexed_tier_blocks += len(hashes)
                        return
                    sub = self._add_tier(tier)
                srep = sub._replica_at(rid, self._replica(rid).bit)
                chunk = hashes[i : i + _CHUNK]
                if stored:
                    assert isinstance(ev, BlockStored)
                    parent = ev.parent_block_hash if i == 0 else hashes[i - 1]
                    sub._store(srep, chunk, parent, ev.block_size)
                else:
                    sub._remove(srep, chunk)

    def _add_tier(self, tier: str) -> PrefixIndex:
        sub = type(self)(self.max_lower_blocks_per_replica, self._clock)  # type: ignore[call-arg]
        self._tiers[tier] = sub  # type: ignore[assignment]
        self.has_lower_tiers = True
        self._tier_list = sorted(self._tiers.items(), key=lambda kv: tier_rank(kv[0]))
        return sub  # type: ignore[return-value]

    def _reset_tiers(self, rid: str) -> None:
        for sub in self._tiers.values():
            srep = sub._replicas.get(rid)
            if srep is not None:
                sub._reset(srep)

    def match_tiers(self, hashes: Sequence[Hash], now: float | None = None) -> dict[str, TierMatch]:
        """Per replica with at least one block in any tier: its device hit (as
        :meth:`~.index.PrefixIndex.match`) and, beyond it, the blocks its lower tiers hold."""
        if type(hashes) is not list and type(hashes) is not tuple:
            hashes = list(hashes)
        if not hashes:
            return {}
        with self._lock:
            device = self._match(hashes, now)
            if not self._tiers:
                return {r: TierMatch(d) for r, d in device.items()}
            bits = {rid: rep.bit for rid, rep in self._replicas.items()}
            tiers = [(t, sub._masks) for t, sub in self._tier_list]
            lower = extend(hashes, device, bits, tiers)
        out = {r: TierMatch(d, tuple(lower.pop(r, ()))) for r, d in device.items()}
        for r, ext in lower.items():
            out[r] = TierMatch(0, tuple(ext))
        return out

    def tiers(self) -> list[str]:
        """The lower tiers indexed, fastest first."""
        return [t for t, _ in self._tier_list]
