"""Prefix index: which replica holds which prefix, rebuilt only from the replicas' KV events.

A chained block hash names its whole prefix, so the index needs no tokens: one entry per
hash, shared by the replicas that hold it (a replica's tree is the entries with its bit set
in their mask). Matching a request is one dict lookup and one integer test per block of its
hash chain.

Tiers: only device copies (``medium`` ``"GPU"``, or none) are device hits. Copies in a lower
tier (host memory ``"CPU"``, local disk ``"STORAGE"``, any other name) are kept apart, one
sub-index per tier (``_tiers``, a :class:`PrefixIndex` each, fed and read under this
index's lock, its replicas under the same bits), and :meth:`PrefixIndex.match_tiers` adds,
beyond each replica's device hit, the run of blocks its lower tiers hold
(:mod:`.index_tiers`: why, and what an unknown medium is credited). A remove names its tier
and takes that tier's copy alone; ``AllBlocksCleared`` and :meth:`drop_replica` clear every
tier. :meth:`match` stays the device's alone.

Invariants (all guarded by ``_lock``):

- ``_masks`` and ``_nodes`` have the same keys, the stored hashes, and no mask is 0. Bit
  ``rep.bit`` of ``_masks[h]`` is set iff ``h`` is in ``rep.blocks`` (stored copies); of
  ``_pmasks[h]`` iff ``h`` is in ``rep.predicted`` (a prediction not yet purged). Never
  both: a store replaces the replica's prediction. Predictions have their own small map so
  that predicting a request's unseen tail never writes into the big one.
- ``rep.blocks`` maps each hash the replica holds to its LRU stamp and ``rep.copies`` its
  count where above 1: stores minus removes of ``h`` on that replica since its last reset (an
  engine may hold two copies of one hash), less what the memory bound forgot. It never
  exceeds what the engine holds, so :meth:`PrefixIndex.match` is exact or an
  under-approximation: forgetting costs hits, never correctness.
- Tree: ``node.parent`` is the parent's hash (None: block 0 of a chain, or unknown). A node
  whose parent node exists is in that node's ``children``; otherwise it waits in
  ``_orphans[parent]`` and is adopted when the parent appears. ``node.depth`` counts the
  blocks before it; while a node's parent exists, ``depth == parent.depth + 1`` (None when
  the parent's is: a chain not yet linked to block 0). An orphan keeps its last depth. A
  None parent never overrides a known one; a conflicting one is counted and ignored. The
  tree serves inspection only: matching reads ``_masks`` alone. (Bogus events can close a
  parent cycle, whose depths cannot all hold; chained hashes cannot, and nothing hangs.)
- ``children`` and ``_orphans`` values are None, one hash, or a dict of hashes to None (an
  untracked set): most nodes have one child, and a container per node would triple the
  index's memory.
- Predictions are sampled: with ``prediction_stride`` K, a request's prediction covers its
  blocks at chain positions p with (p + 1) % K == 0, and its last block. :meth:`match`
  credits a replica with block i when it is predicted at the sampled block at or after i
  in the matched chain (or at the chain's last block): chained hashes make that sound (the
  routed request held the whole prefix up to the sample), and a sibling that diverges
  between samples loses at most K - 1 blocks of credit. K blocks span
  ``PREDICTION_SAMPLE_TOKENS``: 8 for 16-token blocks, 1 (every block) from 128 up. Why: a
  prediction is written on every routed request, and a map of one entry per predicted block
  made each route pay ~500 dict writes for an 8k-token prompt and, at ~100k entries, dict
  resizes of several ms.
- Masks are interned (one object per value, best effort), so ``match`` skips a block whose
  holders are exactly the replicas still matching with one identity test.
- ``rep.blocks`` is an LRU: stores touch entries leaf first, so a chain's shared root is
  forgotten last; past
  ``max_blocks_per_replica`` the least recent entries are forgotten. A touch gives the entry
  the replica's next stamp; ``rep.order`` maps each live stamp back to its hash (a
  bijection with ``rep.blocks``) and no live stamp is below ``rep.low``, so the oldest entry
  is found by counting up from ``rep.low``.
- Tiers: ``_tiers`` maps a lower tier's name (:func:`~kvroute.events.tier_name`, never
  ``"GPU"``) to a sub-index holding that tier's copies, under these invariants itself
  (predictions excepted: it has none). Its replicas are a subset of this index's, each with
  the same bit. At most ``MAX_TIERS`` tiers; blocks of further media are counted
  (``unindexed_tier_blocks``) and dropped.
- Garbage-collector silence: every per-block container is a plain dict of atomic keys and
  values (bytes or int hashes, int masks and stamps, float expiries, None) or a ``gc=False``
  struct, none of which CPython tracks. A full collection therefore never walks the index
  (an OrderedDict LRU, always tracked, made one walk every entry: a pause that grew with
  the index).

Thread-safety: one non-reentrant :class:`threading.Lock`. ``apply`` (the subscriber's
thread, or a front door's loop once the subscriber moved there) takes it per event, and per
256 blocks of a longer event, so ``match`` (asyncio thread, which holds it for its one walk)
never waits long; a reader may see a batch half applied, which
is a state the engine passed through or an under-approximation of one.

Around the structure: :mod:`.index_holdings` (a replica's record, :class:`Holdings`),
:mod:`.index_tree` (the tree's links), :mod:`.index_tiers` (the lower tiers' methods) and
:mod:`.index_views` (sizes, counts, exports and :meth:`PrefixIndex.check_invariants`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from operator import length_hint

from kvroute.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    tier_name,
)
from kvroute.events import ExternalBlockHash as Hash
from kvroute.events.transport import ReplicaBatch

from .index_holdings import Holdings
from .index_tiers import LowerTiers, TierMatch
from .index_tree import Kids, Node, add_kid, discard_kid, fix_depths, link
from .index_views import IndexViews

__all__ = ["PREDICTION_SAMPLE_TOKENS", "PrefixIndex", "TierMatch", "prediction_stride"]

_CHUNK = 256  # blocks applied per lock hold
_INTERN_MAX = 65536  # interned masks kept before the cache starts over
PREDICTION_SAMPLE_TOKENS = 128  # tokens between two predicted blocks (see the docstring)


def prediction_stride(block_size: int) -> int:
    """Blocks between two predicted blocks, for blocks of ``block_size`` tokens."""
    return max(1, PREDICTION_SAMPLE_TOKENS // max(block_size, 1))


def _credit(names: list[str | None], bits: int, n: int, out: dict[str, int]) -> None:
    """``out[replica] = n`` for each replica bit set in ``bits``, if ``n`` > 0."""
    while bits and n:
        low = bits & -bits
        out[names[low.bit_length() - 1]] = n  # type: ignore[index]
        bits ^= low


class PrefixIndex(LowerTiers, IndexViews):
    """Per replica, the blocks it holds; per request, how many leading blocks each holds."""

    def __init__(
        self,
        max_blocks_per_replica: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
        prediction_stride: int = 1,
        max_lower_blocks_per_replica: int | None = None,
    ) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be >= 1")
        # A lower tier is larger than the device's (a host tier of several times it): its
        # bound, per tier, defaults to 4x the device's.
        self.max_lower_blocks_per_replica = max_lower_blocks_per_replica or (
            4 * max_blocks_per_replica
        )
        if prediction_stride < 1:
            raise ValueError("prediction_stride must be >= 1")
        self.max_blocks_per_replica = max_blocks_per_replica
        self.prediction_stride = prediction_stride
        self.parent_conflicts = 0  # stores naming another parent than the one known
        self._clock = clock
        self._lock = threading.Lock()
        self._masks: dict[Hash, int] = {}  # the hot path's map: hash -> bits of its holders
        self._nodes: dict[Hash, Node] = {}  # same keys: the tree, for inspection
        self._pmasks: dict[Hash, int] = {}  # hash -> bits of replicas predicted to hold it
        self._orphans: dict[Hash, Kids] = {}
        self._replicas: dict[str, Holdings] = {}
        self._names: list[str | None] = []  # bit index -> replica id (None: free)
        self._expiries: list[tuple[float, int, str, tuple[Hash, ...]]] = []  # heap
        self._seq = itertools.count()
        self._interned: dict[int, int] = {}
        self._tiers: dict[str, PrefixIndex] = {}  # lower tier -> its copies (docstring)
        self._tier_list: list[tuple[str, PrefixIndex]] = []  # the same, fastest first
        self.has_lower_tiers = False  # a lower tier was ever stored to (matches may extend)
        self.unindexed_tier_blocks = 0  # blocks of tiers beyond MAX_TIERS, dropped

    # -- events (where the subscriber runs) -------------------------------------------------
    def on_batch(self, item: ReplicaBatch) -> None:
        """``ZmqEventSubscriber(on_batch=index.on_batch)``: snapshots and restarts arrive as
        batches that start with AllBlocksCleared, so applying in order is all it takes."""
        self.apply(item.replica_id, item.batch)

    def apply(self, replica_id: str, batch: EventBatch) -> None:
        lock = self._lock
        for ev in batch.events:
            stored = isinstance(ev, BlockStored)
            if not stored and not isinstance(ev, BlockRemoved):
                if not isinstance(ev, AllBlocksCleared):
                    raise TypeError(f"not a KV cache event: {type(ev).__name__}")
                with lock:
                    self._reset(self._replica(replica_id))
                    if self._tiers:
                        self._reset_tiers(replica_id)
                continue
            medium = ev.medium
            if (medium is not None and medium != MEDIUM_GPU) or ev.locality is not None:
                tier = tier_name(medium, ev.locality)
                if tier != MEDIUM_GPU:
                    self._apply_lower(replica_id, tier, ev, stored)
                    continue
            hashes = ev.block_hashes
            if len(hashes) <= _CHUNK:  # the engine's usual event: one lock hold
                with lock:
                    rep = self._replicas.get(replica_id) or self._replica(replica_id)
                    if stored:
                        self._store(rep, hashes, ev.parent_block_hash, ev.block_size)
                    else:
                        self._remove(rep, hashes)
                continue
            for i in range(0, len(hashes), _CHUNK):
                with lock:
                    rep = self._replica(replica_id)
                    if stored:
                        parent = ev.parent_block_hash if i == 0 else hashes[i - 1]
                        self._store(rep, hashes[i : i + _CHUNK], parent, ev.block_size)
                    else:
                        self._remove(rep, hashes[i : i + _CHUNK])

    def _replica_at(self, rid: str, bit: int) -> Holdings:
        """The replica's holdings under ``bit`` (a tier's sub-index: the parent's bit)."""
        rep = self._replicas.get(rid)
        if rep is None:
            idx = bit.bit_length() - 1
            self._names.extend([None] * (idx + 1 - len(self._names)))
            self._names[idx] = rid
            rep = self._replicas[rid] = Holdings(bit)
        return rep

    def _replica(self, rid: str) -> Holdings:
        rep = self._replicas.get(rid)
        if rep is None:  # the lowest free bit: masks stay as short as the fleet is small
            if None not in self._names:
                self._names.append(None)
            idx = self._names.index(None)
            self._names[idx] = rid
            rep = self._replicas[rid] = Holdings(1 << idx)
        return rep

    def _interner(self) -> Callable[[int, int], int]:
        """``intern(mask, mask)`` returns the one object kept for that value, so ``match``
        can compare by identity. Bounded per call, not per mask: a call adds few values."""
        if len(self._interned) > _INTERN_MAX:  # a cache only: a miss takes the slower test
            self._interned.clear()
        return self._interned.setdefault

    def _store(self, rep: Holdings, hashes: Sequence[Hash], parent: Hash | None, bs: int) -> None:
        """One pass over the chunk, most blocks on the first branch (a new hash whose parent
        node is the block before it): locals and inline links, no call per block, as few
        dict operations as the invariants allow. (C-level passes -- map, zip, dict.update --
        were tried and lost: 3.11's specialised dict stores beat ``dict.update(zip(...))``.)"""
        masks, nodes, orphans, predicted = self._masks, self._nodes, self._orphans, rep.predicted
        blocks, order, copies, bit = rep.blocks, rep.order, rep.copies, rep.bit
        intern = self._interner()
        solo = intern(bit, bit)
        s0 = rep.tick
        st = rep.tick = s0 + len(hashes)  # stamps s0.. counted down: the leaf gets the oldest
        pnode = None if parent is None else nodes.get(parent)
        for h in hashes:
            st -= 1
            m = masks.get(h)
            if predicted and predicted.pop(h, None) is not None:  # the real copy replaces it
                self._clear_pbit(h, bit)
            if m is None:
                if pnode is not None:  # pnode exists, h does not: so parent != h
                    d = pnode.depth
                    node = Node(parent, bs, None, None if d is None else d + 1)
                    kids = pnode.children
                    pnode.children = h if kids is None else add_kid(kids, h)
                elif parent is None or parent == h:
                    node = Node(None, bs, None, 0)
                else:  # the parent is not known (yet): wait among the orphans
                    node = Node(parent, bs)
                    orphans[parent] = add_kid(orphans.get(parent), h)
                masks[h] = solo
                nodes[h] = node
                if orphans and (kids := orphans.pop(h, None)) is not None:
                    node.children = kids  # adopt the blocks that arrived before h
                    fix_depths(self._nodes, node)
                blocks[h] = st
                order[st] = h
            else:
                node = nodes[h]
                if parent is not None and node.parent != parent:
                    self._reparent(h, node, parent)
                old = blocks.get(h)
                if old is None:
                    m |= bit
                    masks[h] = intern(m, m)
                    blocks[h] = st
                    order[st] = h
                else:
                    copies[h] = copies.get(h, 1) + 1
                    if old < s0:  # else touched earlier in this chunk, nearer the root
                        del order[old]
                        blocks[h] = st
                        order[st] = h
            parent, pnode = h, node
        if len(blocks) > self.max_blocks_per_replica:
            self._evict(rep)

    def _evict(self, rep: Holdings) -> None:
        """Forget the replica's least recently touched entries, down to the bound."""
        blocks, order, copies = rep.blocks, rep.order, rep.copies
        low = rep.low
        for _ in range(len(blocks) - self.max_blocks_per_replica):
            h = order.pop(low, None)
            if h is None:  # a run of stamps touched again since: skip it in C
                low = next(filter(order.__contains__, itertools.count(low + 1)))
                h = order.pop(low)
            low += 1
            del blocks[h]
            if copies:
                copies.pop(h, None)
            self._clear_bit(h, rep.bit)
            rep.evicted += 1
        rep.low = low

    def _remove(self, rep: Holdings, hashes: Sequence[Hash]) -> None:
        blocks, order, copies, bit = rep.blocks, rep.order, rep.copies, rep.bit
        self._interner()  # bounds the cache _clear_bit adds to
        for h in hashes:
            old = blocks.get(h)
            if old is None:
                rep.unknown_removals += 1
                if rep.predicted.pop(h, None) is not None:
                    self._clear_pbit(h, bit)
            elif copies and h in copies:
                c = copies.pop(h)
                if c > 2:
                    copies[h] = c - 1
            else:
                del blocks[h]
                del order[old]
                self._clear_bit(h, bit)

    def _reset(self, rep: Holdings) -> None:
        self._interner()
        for h in rep.blocks:
            self._clear_bit(h, rep.bit)
        for h in rep.predicted:
            self._clear_pbit(h, rep.bit)
        rep.blocks.clear()
        rep.order.clear()
        rep.copies.clear()
        rep.predicted.clear()
        rep.low = rep.tick

    def _reparent(self, h: Hash, node: Node, parent: Hash) -> None:
        if node.parent is not None or parent == h:
            self.parent_conflicts += 1
            return
        node.parent, node.depth = parent, None  # a root only for want of knowing better
        link(self._nodes, self._orphans, h, node)

    def _clear_pbit(self, h: Hash, bit: int) -> None:
        pmasks = self._pmasks
        mask = pmasks[h] & ~bit
        if mask:
            pmasks[h] = self._interned.setdefault(mask, mask)
        else:
            del pmasks[h]

    def _clear_bit(self, h: Hash, bit: int) -> None:
        masks = self._masks
        mask = masks[h] & ~bit
        if mask:
            masks[h] = self._interned.setdefault(mask, mask)
            return
        del masks[h]
        node = self._nodes.pop(h)
        parent = node.parent
        if parent is not None:
            if (p := self._nodes.get(parent)) is not None:
                p.children = discard_kid(p.children, h)
            elif (rest := discard_kid(self._orphans.get(parent), h)) is None:
                self._orphans.pop(parent, None)
            else:
                self._orphans[parent] = rest
        if node.children is not None:
            self._orphans[h] = node.children  # they keep their parent hash and depth

    # -- routing (asyncio thread) ----------------------------------------------------------
    def match(self, hashes: Sequence[Hash], now: float | None = None) -> dict[str, int]:
        """Per replica with at least one hit, the number of leading blocks of ``hashes`` it
        holds (stored or predicted). One walk; stops when no replica is left."""
        if type(hashes) is not list and type(hashes) is not tuple:
            hashes = list(hashes)
        if not hashes:
            return {}
        with self._lock:
            return self._match(hashes, now)

    def _match(self, hashes: Sequence[Hash], now: float | None = None) -> dict[str, int]:
        """:meth:`match`'s walk, under the lock, over a non-empty list or tuple."""
        total, out = len(hashes), {}
        if self._expiries:
            self._expire(self._clock() if now is None else now)
        # Lookups run in C (map); the block number is only needed when a replica drops
        # out, and is read off the list iterator then: this loop is the routing hot path.
        # Its cost is memory, not bytecode: one cache miss per block in a dict of ~1 M.
        # Predictions are consulted only where the stored masks would drop a replica.
        pmasks, interned, k, last = (
            self._pmasks,
            self._interned,
            self.prediction_stride,
            total - 1,
        )
        rest = iter(hashes)
        masks = map(self._masks.get, rest, itertools.repeat(0))
        alive = next(masks, 0)
        if pmasks:
            alive |= pmasks.get(hashes[min(k - 1, last)], 0)
            alive = interned.get(alive, alive)
        if not alive:
            return out
        for m in masks:
            if m is alive:  # interned: the same holders as the block before
                continue
            if (m & alive) != alive:  # some replicas miss this block (all, if m is 0)
                i = total - length_hint(rest) - 1
                if pmasks:  # the sampled block at or after i (see the docstring)
                    m |= pmasks.get(hashes[min(i + k - 1 - i % k, last)], 0)
                    if (m & alive) == alive:
                        continue
                _credit(self._names, alive & ~m, i, out)
                alive = interned.get(alive & m, alive & m)
                if not alive:
                    return out
        _credit(self._names, alive, total, out)
        return out

    def predict(
        self, replica_id: str, hashes: Sequence[Hash], ttl_s: float = 2.0, now: float | None = None
    ) -> int:
        """A request was just routed to ``replica_id``: count its blocks there until they
        expire or real events arrive, so its siblings follow it. Returns blocks predicted
        (with ``prediction_stride`` above 1, the sampled ones: see the module docstring).

        Predictions live in their own map, small because they are short-lived, beside the
        stored one of ~1 M entries: this is the larger half of the routing hot path, and a
        store into the big map is a cache miss per block. Blocks the replica holds are left
        as they are (a prediction does not touch the index's LRU, a safety bound far above
        what any engine holds; an engine's own evictions arrive as events)."""
        with self._lock:
            now = self._clock() if now is None else now
            self._expire(now)
            rep = self._replica(replica_id)
            pmasks, blocks, predicted, bit = self._pmasks, rep.blocks, rep.predicted, rep.bit
            intern = self._interner()
            room = self.max_blocks_per_replica - len(predicted)  # predictions the bound allows
            expiry, added = now + ttl_s, []
            lead = len(list(itertools.takewhile(blocks.__contains__, hashes)))  # held: skip
            n, k = len(hashes), self.prediction_stride
            if k == 1:
                rest = hashes[lead:] if lead else hashes
            elif lead < n:  # the samples at or after lead, and the last block
                rest = list(hashes[lead + (k - 1 - lead % k) : n : k])
                if n % k:
                    rest.append(hashes[n - 1])
            else:
                rest = []
            if (
                rest
                and len(rest) <= room
                and pmasks.keys().isdisjoint(rest)
                and blocks.keys().isdisjoint(rest)
            ):  # the usual case, a tail predicted nowhere yet: in bulk, at C speed
                solo = intern(bit, bit)
                pmasks.update(zip(rest, itertools.repeat(solo)))
                predicted.update(zip(rest, itertools.repeat(expiry)))
                added = list(rest)
            else:
                for h in rest:
                    if h in blocks:
                        continue
                    old = predicted.get(h)
                    if old is None:
                        if room <= 0:
                            continue
                        m = pmasks.get(h, 0) | bit
                        pmasks[h] = intern(m, m)
                        predicted[h] = expiry
                        room -= 1
                    elif old < expiry:
                        predicted[h] = expiry
                    added.append(h)
            if added:
                heapq.heappush(self._expiries, (expiry, next(self._seq), replica_id, tuple(added)))
            return len(added)

    def _expire(self, now: float) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, _, rid, hashes = heapq.heappop(heap)
            rep = self._replicas.get(rid)
            if rep is None:
                continue
            for h in hashes:
                exp = rep.predicted.get(h)
                if exp is not None and exp <= now:  # else renewed, or replaced by a store
                    del rep.predicted[h]
                    self._clear_pbit(h, rep.bit)

    # -- membership (inspection and metrics: :mod:`.index_views`) -------------------------
    def drop_replica(self, replica_id: str) -> bool:
        """Forget a replica that went away, in O(its blocks). False if it was unknown.
        Events that arrive for it later bring it back: stop its subscription first."""
        with self._lock:
            return self._drop(replica_id)

    def _drop(self, replica_id: str) -> bool:
        rep = self._replicas.pop(replica_id, None)
        if rep is None:
            return False
        self._reset(rep)
        self._names[rep.bit.bit_length() - 1] = None
        for sub in self._tiers.values():  # no stale lower-tier copy outlives it
            sub._drop(replica_id)
        return True
