"""PrefixIndex's memory bound: past it the least recently stored blocks go, leaves before
roots, matches stay an under-approximation, and the order equals a reference LRU."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvroute.events import AllBlocksCleared, BlockRemoved
from kvroute.router.routing.index import PrefixIndex

from .index_truth import Fleet, brute_match, feed, stored


def test_memory_bound_evicts_and_match_stays_an_under_approximation() -> None:
    cap = 40
    index, fleet, rng = (
        PrefixIndex(max_blocks_per_replica=cap),
        Fleet(3, seed=400),
        random.Random(4),
    )
    for _ in range(300):
        fleet.step(index)
        assert all(index.num_blocks(r) <= cap for r in index.replicas())
    truths = fleet.truths()
    assert all(len(t) > cap for t in truths.values())  # the bound really bit
    assert all(index.export(r)["evicted"] > 0 for r in truths)
    index.check_invariants()
    for rid, truth in truths.items():
        for h, copies in index.counts(rid).items():
            assert copies <= truth[h]
    hits = 0
    for chain in fleet.chains(rng):
        exact, got = brute_match(truths, chain), index.match(chain)
        assert all(0 < n <= exact.get(rid, 0) for rid, n in got.items()), (got, exact)
        for rid, n in got.items():  # what is credited, the replica really holds
            assert all(truths[rid][h] for h in chain[:n])
        hits += sum(got.values())
    assert hits > 0


def test_eviction_forgets_a_chains_leaf_before_its_root() -> None:
    index = PrefixIndex(max_blocks_per_replica=4)
    a, b, c, x, y = (bytes([i]) * 16 for i in range(1, 6))
    feed(index, "r0", stored([a, b, c]), stored([x]), stored([y]))
    assert index.match([a, b, c]) == {"r0": 2}
    # A store touches its blocks: re-storing the chain keeps it over newer, untouched ones.
    feed(index, "r0", stored([a, b]), stored([c], b), stored([b"\x09" * 16]))
    assert index.match([a, b, c]) == {"r0": 3} and index.num_blocks("r0") == 4


class ReferenceLRU:
    """The memory bound's rule on an OrderedDict, as the index implemented it before LRU
    stamps: a store counts each hash, then touches the event's hashes leaf first (so a
    chain's root is the most recent); past the bound the least recent go. Removes, clears
    and predictions touch nothing."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.d: OrderedDict = OrderedDict()

    def store(self, hashes: list) -> None:
        for h in hashes:
            self.d[h] = self.d.get(h, 0) + 1
        self.touch(hashes)
        while len(self.d) > self.cap:
            self.d.popitem(last=False)

    def touch(self, hashes: list) -> None:
        for h in reversed(hashes):
            if h in self.d:
                self.d.move_to_end(h)

    def remove(self, hashes: list) -> None:
        for h in hashes:
            if h in self.d:
                self.d[h] -= 1
                if not self.d[h]:
                    del self.d[h]


@pytest.mark.parametrize("form", ["bytes", "int"])
def test_eviction_order_equals_a_reference_lru(form: str) -> None:
    """Duplicates within an event, copies, predictions (which touch nothing), removes and
    clears, on a small universe so that the bound bites all the time: the index forgets
    exactly what an LRU would, and ``counts`` lists what it keeps least recent first."""
    rng, cap = random.Random(8), 12
    universe = [i.to_bytes(16, "big") if form == "bytes" else i for i in range(1, 41)]
    index = PrefixIndex(max_blocks_per_replica=cap, clock=lambda: 0.0)
    refs = {rid: ReferenceLRU(cap) for rid in ("r0", "r1")}
    evicted = 0
    for step in range(3000):
        rid = rng.choice(list(refs))
        ref, r = refs[rid], rng.random()
        if r < 0.5:
            hs = sorted(rng.sample(universe, rng.randint(1, 8)))  # ascending: no parent cycle
            if rng.random() < 0.2:  # the same hash twice in one event
                i = rng.randrange(len(hs))
                hs.insert(i, hs[i])
            parent = rng.choice([None, *(u for u in universe if u < hs[0])])
            feed(index, rid, stored(hs, parent))
            before = len(ref.d) + len(set(hs) - ref.d.keys())
            ref.store(hs)
            evicted += max(0, before - cap)
        elif r < 0.7:
            hs = rng.sample(universe, rng.randint(1, 6))
            feed(index, rid, BlockRemoved(hs, "GPU"))
            ref.remove(hs)
        elif r < 0.97:
            hs = sorted(rng.sample(universe, rng.randint(1, 10)))
            index.predict(rid, hs, ttl_s=rng.choice([0.0, 5.0]), now=0.0)
        else:
            feed(index, rid, AllBlocksCleared())
            ref.d.clear()
        assert list(index.counts(rid).items()) == list(ref.d.items()), step
        if step % 100 == 0:
            index.check_invariants()
    assert evicted > 500  # the bound really bit, often
    assert sum(index.export(rid)["evicted"] for rid in refs) == evicted
    index.check_invariants()
