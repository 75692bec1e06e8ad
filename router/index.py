"""Prefix index: which replica holds which prefix, rebuilt only from the replicas' KV events.

A chained block hash names its whole prefix, so the index needs no tokens: one entry per
hash, shared by the replicas that hold it (a replica's tree is the entries with its bit set
in their mask). Matching a request is one dict lookup and one integer test per block of its
hash chain. Copies on any medium (GPU, CPU offload) count alike, as they do in BlockSet.

Invariants (all guarded by ``_lock``):

- ``_masks`` and ``_nodes`` have the same keys, and no mask is 0. Bit ``rep.bit`` of
  ``_masks[h]`` is set iff ``h`` is in ``rep.blocks`` (stored copies) or in
  ``rep.predicted`` (a prediction not yet purged), never both.
- ``rep.blocks[h] >= 1`` counts stores minus removes of ``h`` on that replica since its last
  reset (an engine may hold two copies of one hash), less what the memory bound forgot. It
  never exceeds what the engine holds, so :meth:`PrefixIndex.match` is exact or an
  under-approximation: forgetting costs hits, never correctness.
- Tree: ``node.parent`` is the parent's hash (None: block 0 of a chain, or unknown). A node
  whose parent node exists is in that node's ``children``; otherwise it waits in
  ``_orphans[parent]`` and is adopted when the parent appears. ``node.depth`` counts the
  blocks before it; while a node's parent exists, ``depth == parent.depth + 1`` (None when
  the parent's is: a chain not yet linked to block 0). An orphan keeps its last depth. A
  None parent never overrides a known one; a conflicting one is counted and ignored. The
  tree serves inspection only: matching reads ``_masks`` alone.
- ``children`` and ``_orphans`` values are None, one hash, or a set of hashes: most nodes
  have one child, and a set per node would triple the index's memory.
- Masks are interned (one object per value, best effort), so ``match`` skips a block whose
  holders are exactly the replicas still matching with one identity test.
- ``rep.blocks`` is an LRU: stores, and :meth:`PrefixIndex.predict` (a request was just
  routed there), touch entries leaf first, so a chain's shared root is forgotten last; past
  ``max_blocks_per_replica`` the least recent entries are forgotten.

Thread-safety: one non-reentrant :class:`threading.Lock`. ``apply`` (subscriber thread) takes
it per event, and per 256 blocks of a longer event, so ``match`` (asyncio thread, which
holds it for its one walk) never waits long; a reader may see a batch half applied, which
is a state the engine passed through or an under-approximation of one.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from operator import length_hint
from typing import Any

import msgspec

from kvroute.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, ReplicaBatch
from kvroute.events import ExternalBlockHash as Hash

_Kids = Hash | set[Hash] | None  # compact child set, see module docstring
_CHUNK = 256  # blocks applied per lock hold
# Approximate bytes per node / stored entry / prediction (measured on CPython 3.11, 16-byte
# digests): node object + its slot in _nodes + the key; OrderedDict entry; dict entry.
_NODE_BYTES, _ENTRY_BYTES, _PRED_BYTES = 200, 110, 70


class _Node(msgspec.Struct, gc=False):
    """Tree links of one hash. Untracked by the garbage collector (it holds no cycles), so
    a million of them add nothing to the collector's pauses."""

    parent: Hash | None
    tokens: int  # tokens in this block (0: only predicted so far)
    children: _Kids = None
    depth: int | None = None


class _Replica:
    __slots__ = ("bit", "blocks", "evicted", "predicted", "unknown_removals")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.blocks: OrderedDict[Hash, int] = OrderedDict()  # hash -> copies, LRU order
        self.predicted: dict[Hash, float] = {}  # hash -> expiry
        self.evicted = 0  # entries forgotten by the memory bound
        self.unknown_removals = 0  # removes of hashes the index did not hold


def _add(kids: _Kids, h: Hash) -> _Kids:
    if type(kids) is set:
        kids.add(h)
        return kids
    return h if kids is None or kids == h else {kids, h}


def _discard(kids: _Kids, h: Hash) -> _Kids:
    if type(kids) is set:
        kids.discard(h)
        return kids if len(kids) > 1 else next(iter(kids), None)
    return None if kids == h else kids


def _members(kids: _Kids) -> Iterable[Hash]:
    return () if kids is None else kids if type(kids) is set else (kids,)


def _external(h: Hash | None) -> str | int | None:
    return h.hex() if isinstance(h, bytes) else h


class PrefixIndex:
    """Per replica, the blocks it holds; per request, how many leading blocks each holds."""

    def __init__(
        self,
        max_blocks_per_replica: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be >= 1")
        self.max_blocks_per_replica = max_blocks_per_replica
        self.parent_conflicts = 0  # stores naming another parent than the one known
        self._clock = clock
        self._lock = threading.Lock()
        self._masks: dict[Hash, int] = {}  # the hot path's map: hash -> replica bits
        self._nodes: dict[Hash, _Node] = {}  # same keys: the tree, for inspection
        self._orphans: dict[Hash, _Kids] = {}
        self._replicas: dict[str, _Replica] = {}
        self._names: list[str | None] = []  # bit index -> replica id (None: free)
        self._expiries: list[tuple[float, int, str, tuple[Hash, ...]]] = []  # heap
        self._seq = itertools.count()
        self._interned: dict[int, int] = {}

    # -- events (subscriber thread) --------------------------------------------------------
    def on_batch(self, item: ReplicaBatch) -> None:
        """``ZmqEventSubscriber(on_batch=index.on_batch)``: snapshots and restarts arrive as
        batches that start with AllBlocksCleared, so applying in order is all it takes."""
        self.apply(item.replica_id, item.batch)

    def apply(self, replica_id: str, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                with self._lock:
                    self._reset(self._replica(replica_id))
                continue
            if not isinstance(ev, BlockStored | BlockRemoved):
                raise TypeError(f"not a KV cache event: {type(ev).__name__}")
            hashes = ev.block_hashes
            for i in range(0, len(hashes), _CHUNK):
                chunk = hashes if len(hashes) <= _CHUNK else hashes[i : i + _CHUNK]
                with self._lock:
                    rep = self._replica(replica_id)
                    if isinstance(ev, BlockStored):
                        parent = ev.parent_block_hash if i == 0 else hashes[i - 1]
                        self._store(rep, chunk, parent, ev.block_size)
                    else:
                        self._remove(rep, chunk)

    def _replica(self, rid: str) -> _Replica:
        rep = self._replicas.get(rid)
        if rep is None:  # the lowest free bit: masks stay as short as the fleet is small
            if None not in self._names:
                self._names.append(None)
            idx = self._names.index(None)
            self._names[idx] = rid
            rep = self._replicas[rid] = _Replica(1 << idx)
        return rep

    def _store(self, rep: _Replica, hashes: Sequence[Hash], parent: Hash | None, bs: int) -> None:
        blocks, masks, bit = rep.blocks, self._masks, rep.bit
        for h in hashes:
            if h not in masks:
                self._new_node(h, parent, bs, bit)
                blocks[h] = 1
            else:
                node = self._nodes[h]
                if parent is not None and node.parent != parent:
                    self._reparent(h, node, parent)
                if not node.tokens:
                    node.tokens = bs
                copies = blocks.get(h)
                if copies is not None:
                    blocks[h] = copies + 1
                else:
                    blocks[h] = 1
                    if rep.predicted.pop(h, None) is None:  # else the real copy replaces it
                        masks[h] = self._intern(masks[h] | bit)
            parent = h
        for h in reversed(hashes):  # leaf first: a chain's root is the last forgotten
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks_per_replica:
            h, _ = blocks.popitem(last=False)
            self._clear_bit(h, bit)
            rep.evicted += 1

    def _remove(self, rep: _Replica, hashes: Sequence[Hash]) -> None:
        blocks = rep.blocks
        for h in hashes:
            copies = blocks.get(h)
            if copies is None:
                rep.unknown_removals += 1
                if rep.predicted.pop(h, None) is not None:
                    self._clear_bit(h, rep.bit)
            elif copies > 1:
                blocks[h] = copies - 1
            else:
                del blocks[h]
                self._clear_bit(h, rep.bit)

    def _reset(self, rep: _Replica) -> None:
        for h in itertools.chain(rep.blocks, rep.predicted):
            self._clear_bit(h, rep.bit)
        rep.blocks.clear()
        rep.predicted.clear()

    # -- tree upkeep -----------------------------------------------------------------------
    def _new_node(self, h: Hash, parent: Hash | None, tokens: int, mask: int) -> None:
        self._masks[h] = self._intern(mask)
        node = self._nodes[h] = _Node(None if parent == h else parent, tokens)
        node.children = self._orphans.pop(h, None)
        self._link(h, node)

    def _link(self, h: Hash, node: _Node) -> None:
        """Hang ``node`` under its parent (or among the orphans) and fix depths below it."""
        parent = node.parent
        if parent is None:
            depth: int | None = 0
        elif (p := self._nodes.get(parent)) is not None:
            p.children = _add(p.children, h)
            depth = None if p.depth is None else p.depth + 1
        else:
            self._orphans[parent] = _add(self._orphans.get(parent), h)
            depth = node.depth
        if node.children is None:
            node.depth = depth
            return
        stack, seen = [(node, depth)], set()  # seen: bogus events may close a cycle
        while stack:
            n, d = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            n.depth = d
            cd = None if d is None else d + 1
            for c in _members(n.children):
                child = self._nodes[c]
                if child.depth != cd:
                    stack.append((child, cd))

    def _intern(self, mask: int) -> int:
        """One object per mask value, so ``match`` can compare by identity in its loop."""
        if len(self._interned) > 65536:  # a cache only: a miss just takes the slower test
            self._interned.clear()
        return self._interned.setdefault(mask, mask)

    def _reparent(self, h: Hash, node: _Node, parent: Hash) -> None:
        if node.parent is not None or parent == h:
            self.parent_conflicts += 1
            return
        node.parent, node.depth = parent, None  # a root only for want of knowing better
        self._link(h, node)

    def _clear_bit(self, h: Hash, bit: int) -> None:
        mask = self._masks[h] & ~bit
        if mask:
            self._masks[h] = self._intern(mask)
            return
        del self._masks[h]
        node = self._nodes.pop(h)
        parent = node.parent
        if parent is not None:
            if (p := self._nodes.get(parent)) is not None:
                p.children = _discard(p.children, h)
            elif (rest := _discard(self._orphans.get(parent), h)) is None:
                self._orphans.pop(parent, None)
            else:
                self._orphans[parent] = rest
        if node.children is not None:
            self._orphans[h] = node.children  # they keep their parent hash and depth

    # -- routing (asyncio thread) ----------------------------------------------------------
    def match(self, hashes: Sequence[Hash], now: float | None = None) -> dict[str, int]:
        """Per replica with at least one hit, the number of leading blocks of ``hashes`` it
        holds (stored or predicted). One walk; stops when no replica is left."""
        if not isinstance(hashes, list | tuple):
            hashes = list(hashes)
        total, out = len(hashes), {}
        with self._lock:
            if self._expiries:
                self._expire(self._clock() if now is None else now)
            # Lookups run in C (map); the block number is only needed when a replica drops
            # out, and is read off the list iterator then: this loop is the routing hot path.
            rest = iter(hashes)
            masks = map(self._masks.get, rest, itertools.repeat(0))
            alive = next(masks, 0)
            if not alive:
                return out
            for m in masks:
                if m is alive:  # interned: the same holders as the block before
                    continue
                if (m & alive) != alive:  # some replicas miss this block (all, if m is 0)
                    _credit(self._names, alive & ~m, total - length_hint(rest) - 1, out)
                    alive = self._interned.get(alive & m, alive & m)
                    if not alive:
                        return out
            _credit(self._names, alive, total, out)
        return out

    def predict(
        self,
        replica_id: str,
        hashes: Sequence[Hash],
        ttl_s: float = 2.0,
        now: float | None = None,
        parent: Hash | None = None,
    ) -> int:
        """A request was just routed to ``replica_id``: count its blocks there until they
        expire or real events arrive, so its siblings follow it. Returns blocks predicted.

        ``parent`` is the hash before ``hashes[0]`` (None when they start at block 0).
        Blocks the replica already holds are touched in its LRU instead."""
        with self._lock:
            now = self._clock() if now is None else now
            self._expire(now)
            rep = self._replica(replica_id)
            expiry, added, held = now + ttl_s, [], []
            for h in hashes:
                if h in rep.blocks:
                    held.append(h)
                elif h in rep.predicted or len(rep.predicted) < self.max_blocks_per_replica:
                    node = self._nodes.get(h)
                    if node is None:
                        self._new_node(h, parent, 0, rep.bit)
                    else:
                        if parent is not None and node.parent != parent:
                            self._reparent(h, node, parent)
                        self._masks[h] = self._intern(self._masks[h] | rep.bit)
                    rep.predicted[h] = max(expiry, rep.predicted.get(h, expiry))
                    added.append(h)
                parent = h
            for h in reversed(held):
                rep.blocks.move_to_end(h)
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
                    self._clear_bit(h, rep.bit)

    # -- membership, inspection, metrics ---------------------------------------------------
    def drop_replica(self, replica_id: str) -> bool:
        """Forget a replica that went away, in O(its blocks). False if it was unknown.
        Events that arrive for it later bring it back: stop its subscription first."""
        with self._lock:
            rep = self._replicas.pop(replica_id, None)
            if rep is None:
                return False
            self._reset(rep)
            self._names[rep.bit.bit_length() - 1] = None
            return True

    def __len__(self) -> int:
        """Distinct hashes indexed (predicted ones included)."""
        return len(self._nodes)

    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._replicas)

    def num_blocks(self, replica_id: str) -> int:
        """Distinct hashes the replica holds per its events (predictions excluded)."""
        rep = self._replicas.get(replica_id)
        return len(rep.blocks) if rep else 0

    def num_predicted(self, replica_id: str, now: float | None = None) -> int:
        with self._lock:
            self._expire(self._clock() if now is None else now)
            rep = self._replicas.get(replica_id)
            return len(rep.predicted) if rep else 0

    def counts(self, replica_id: str) -> dict[Hash, int]:
        """Hash -> copies held by the replica (a copy, safe to keep)."""
        with self._lock:
            rep = self._replicas.get(replica_id)
            return dict(rep.blocks) if rep else {}

    def memory_bytes(self) -> int:
        """Approximate heap bytes, for metrics (calibrated constants, not a measurement)."""
        with self._lock:
            entries = sum(len(r.blocks) for r in self._replicas.values())
            preds = sum(len(r.predicted) for r in self._replicas.values())
            return len(self._nodes) * _NODE_BYTES + entries * _ENTRY_BYTES + preds * _PRED_BYTES

    def export(self, replica_id: str) -> dict[str, Any]:
        """The replica's tree as JSON-ready data: bytes hashes as hex, int hashes as ints."""
        with self._lock:
            self._expire(self._clock())
            rep = self._replicas.get(replica_id)
            if rep is None:
                raise KeyError(replica_id)
            held = [*rep.blocks.items(), *((h, 0) for h in rep.predicted)]  # 0: predicted
            nodes = [self._export_node(h, copies) for h, copies in held]
            out: dict[str, Any] = {
                "replica_id": replica_id,
                "num_blocks": len(rep.blocks),
                "num_predicted": len(rep.predicted),
                "num_tokens": sum(d["tokens"] for d in nodes if d["copies"]),
                "evicted": rep.evicted,
                "unknown_removals": rep.unknown_removals,
            }
        nodes.sort(key=lambda d: (d["depth"] is None, d["depth"] or 0))
        out["nodes"] = nodes
        return out

    def _export_node(self, h: Hash, copies: int) -> dict[str, Any]:
        n = self._nodes[h]
        out = dict(hash=_external(h), parent=_external(n.parent), depth=n.depth, tokens=n.tokens)
        return out | {"copies": copies, "predicted": not copies}

    def check_invariants(self) -> None:
        """Asserts the module docstring's invariants, in O(size): for tests and debugging."""
        with self._lock:
            want: dict[Hash, int] = {}
            for rep in self._replicas.values():
                assert not rep.blocks.keys() & rep.predicted.keys(), "stored and predicted"
                assert all(c >= 1 for c in rep.blocks.values()), "zero count kept"
                assert len(rep.blocks) <= self.max_blocks_per_replica, "bound exceeded"
                for h in itertools.chain(rep.blocks, rep.predicted):
                    want[h] = want.get(h, 0) | rep.bit
            assert self._masks == want and self._nodes.keys() == want.keys(), "masks disagree"
            for h, node in self._nodes.items():
                p = self._nodes.get(node.parent) if node.parent is not None else None
                if node.parent is None:
                    assert node.depth == 0, f"root {h!r} at depth {node.depth}"
                elif p is None:
                    assert h in _members(self._orphans.get(node.parent)), f"{h!r} lost"
                else:
                    assert h in _members(p.children), f"{h!r} not among its parent's children"
                    assert node.depth == (None if p.depth is None else p.depth + 1), "depth"
                for c in _members(node.children):
                    assert self._nodes[c].parent == h, "child names another parent"
            for parent, kids in self._orphans.items():
                assert parent not in self._nodes, "orphan of a present parent"
                for c in _members(kids):
                    assert self._nodes[c].parent == parent, "orphan names another parent"


def _credit(names: list[str | None], bits: int, n: int, out: dict[str, int]) -> None:
    """``out[replica] = n`` for each replica bit set in ``bits``, if ``n`` > 0."""
    while bits and n:
        low = bits & -bits
        out[names[low.bit_length() - 1]] = n  # type: ignore[index]
        bits ^= low
