"""PrefixIndex: exact per-replica counts under churn, leading-block matching checked against
a brute-force reference, memory bound and LRU order against a reference LRU, predictions,
export, garbage-collector silence, and a real ZeroMQ stream."""

from __future__ import annotations

import gc
import json
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

import pytest

from kvroute.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    to_external,
)
from kvroute.events.transport import ReplicaBatch, ZmqEventPublisher, ZmqEventSubscriber
from kvroute.router.routing.index import PrefixIndex

from ...events.transport.streams import BS, Churn
from ...waiting import poll

LOCAL = "tcp://127.0.0.1:*"


def stored(hashes: list, parent=None) -> BlockStored:
    return BlockStored(list(hashes), parent, [1] * (BS * len(hashes)), BS, None, "GPU", None)


def feed(index: PrefixIndex, rid: str, *events: KVCacheEvent) -> None:
    index.apply(rid, EventBatch(0.0, list(events)))


def convert(events: list[KVCacheEvent], form: str) -> list[KVCacheEvent]:
    """The same events with hashes in vLLM's uint64 form (``form="int"``)."""
    if form == "bytes":
        return events
    x = lambda h: None if h is None else to_external(h, "int")  # noqa: E731
    out: list[KVCacheEvent] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(stored([x(h) for h in ev.block_hashes], x(ev.parent_block_hash)))
        elif isinstance(ev, BlockRemoved):
            out.append(BlockRemoved([x(h) for h in ev.block_hashes], ev.medium))
        else:
            out.append(ev)
    return out


def brute_match(truths: dict[str, Counter], chain: Sequence) -> dict[str, int]:
    """Reference: per replica, leading blocks of ``chain`` it holds (zeros left out)."""
    out = {}
    for rid, truth in truths.items():
        n = 0
        while n < len(chain) and truth[chain[n]] > 0:
            n += 1
        if n:
            out[rid] = n
    return out


class Fleet:
    """Several fake replicas driven by Churn, with the chains their stores built."""

    def __init__(self, n: int, seed: int, form: str = "bytes", clear_every: int = 0) -> None:
        # Replicas clear at different steps (clear_every + 7 i), as engines would.
        self.churns = {
            f"r{i}": Churn(seed + i, clear_every and clear_every + 7 * i) for i in range(n)
        }
        for i, c in enumerate(self.churns.values()):
            c.next_id = 40 * i  # hash ranges overlap partly: shared and private hashes
        self.form = form
        self.parents: dict[str, dict] = {rid: {} for rid in self.churns}

    def step(
        self, index: PrefixIndex | None = None, only: str | None = None
    ) -> dict[str, list[KVCacheEvent]]:
        out = {}
        for rid in [only] if only else self.churns:
            events = convert(self.churns[rid].step(), self.form)
            for ev in events:
                if isinstance(ev, BlockStored):
                    parent = ev.parent_block_hash
                    for h in ev.block_hashes:
                        self.parents[rid].setdefault(h, parent)  # first store is the real one
                        parent = h
            if index is not None:
                index.apply(rid, EventBatch(0.0, events))
            out[rid] = events
        return out

    def truths(self) -> dict[str, Counter]:
        x = (lambda h: h) if self.form == "bytes" else (lambda h: to_external(h, "int"))
        return {
            rid: Counter({x(h): c for h, c in churn.truth.items()})
            for rid, churn in self.churns.items()
        }

    def chains(self, rng: random.Random, k: int = 200) -> list[list]:
        """Root-to-block chains as the replicas stored them, some cut or with a foreign hash
        spliced in (a replica holding block i but not i-1 must get no credit past i-1)."""
        out = []
        for _ in range(k):
            rid = rng.choice(list(self.parents))
            h = rng.choice(list(self.parents[rid]))
            chain = [h]
            while (p := self.parents[rid].get(chain[-1])) is not None and len(chain) < 1000:
                chain.append(p)
            chain.reverse()
            r = rng.random()
            if r < 0.2 and len(chain) > 1:
                chain.insert(rng.randrange(1, len(chain)), rng.choice(list(self.parents[rid])))
            elif r < 0.3:
                chain.append(b"\xff" * 16 if self.form == "bytes" else 2**64 - 1)
            out.append(chain)
        return out


def assert_matches_truth(index: PrefixIndex, fleet: Fleet, rng: random.Random) -> list[dict]:
    truths = fleet.truths()
    for rid, truth in truths.items():
        assert index.counts(rid) == dict(truth), rid
        assert index.num_blocks(rid) == len(truth)
    assert len(index) == len(set().union(*truths.values()))
    index.check_invariants()
    matches = []
    for chain in fleet.chains(rng):
        matches.append(index.match(chain))
        assert matches[-1] == brute_match(truths, chain), chain
    return matches


@pytest.mark.parametrize("form", ["bytes", "int"])
@pytest.mark.parametrize("clear_every", [0, 23])
def test_churn_counts_and_matches_equal_the_truth(form: str, clear_every: int) -> None:
    index, fleet, rng = (
        PrefixIndex(),
        Fleet(4, seed=100, form=form, clear_every=clear_every),
        random.Random(1),
    )
    matches: list[dict] = []
    for step in range(1, 301):
        fleet.step(index)
        if step % 30 == 0:
            matches += assert_matches_truth(index, fleet, rng)
    # The checks were not vacuous: shared chains, and deep ones, were matched.
    assert sum(len(m) >= 2 for m in matches) > 10
    assert sum(bool(m) and max(m.values()) >= 3 for m in matches) > 10


def test_duplicate_copies_are_counted() -> None:
    index, h, g = PrefixIndex(), b"\x01" * 16, b"\x02" * 16
    feed(index, "r0", stored([h]), stored([h, g]))
    feed(index, "r1", stored([h]))
    feed(index, "r0", BlockRemoved([h], "GPU"))
    assert index.counts("r0") == {h: 1, g: 1}
    assert index.match([h, g]) == {"r0": 2, "r1": 1}
    feed(index, "r0", BlockRemoved([h], "GPU"))
    assert index.counts("r0") == {g: 1}
    assert index.match([h, g]) == {"r1": 1}  # r0 holds g but not its prefix
    feed(index, "r0", BlockRemoved([h], "GPU"))  # a remove of nothing stays harmless
    assert index.export("r0")["unknown_removals"] == 1
    assert index.counts("r1") == {h: 1}
    index.check_invariants()


def test_drop_replica_removes_all_and_only_that_replica() -> None:
    index, fleet, rng = PrefixIndex(), Fleet(3, seed=200), random.Random(2)
    for _ in range(150):
        fleet.step(index)
    chains = fleet.chains(rng)
    assert any("r1" in index.match(c) for c in chains)
    assert index.drop_replica("r1") and not index.drop_replica("r1")
    assert index.replicas() == ["r0", "r2"]
    assert index.num_blocks("r1") == 0 and index.counts("r1") == {}
    truths = fleet.truths()
    del truths["r1"]
    for rid, truth in truths.items():
        assert index.counts(rid) == dict(truth)
    assert len(index) == len(set().union(*truths.values()))
    index.check_invariants()
    feed(index, "r9", stored([b"\x00" * 15 + b"\x07"]))  # may reuse r1's bit: must not inherit
    for chain in chains:
        assert index.match(chain) == brute_match(truths | {"r9": Counter()}, chain)


def test_reset_of_one_replica_leaves_the_others_intact() -> None:
    index, fleet, rng = PrefixIndex(), Fleet(3, seed=300), random.Random(3)
    for _ in range(150):
        fleet.step(index)
    a, b = b"\x0a" * 16, b"\x0b" * 16
    # How a snapshot (or a restart) arrives from the subscriber: cleared, then the state.
    snap = EventBatch(0.0, [AllBlocksCleared(), stored([a]), stored([b], a), stored([b], a)])
    index.on_batch(ReplicaBatch("r0", 7, snap, "snapshot"))
    assert index.counts("r0") == {a: 1, b: 2}
    truths = fleet.truths()
    for rid in ("r1", "r2"):
        assert index.counts(rid) == dict(truths[rid])
    truths["r0"] = Counter({a: 1, b: 2})
    index.check_invariants()
    for chain in [*fleet.chains(rng), [a, b]]:
        assert index.match(chain) == brute_match(truths, chain)


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


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_predictions_count_expire_and_yield_to_real_events() -> None:
    clock = FakeClock()
    index = PrefixIndex(clock=clock)
    a, b, c, d = (bytes([i]) * 16 for i in range(1, 5))
    feed(index, "r0", stored([a]))
    assert index.predict("r0", [a, b, c], ttl_s=2.0) == 2  # a is really held already
    assert index.match([a, b, c, d]) == {"r0": 3}
    assert index.counts("r0") == {a: 1} and index.num_predicted("r0") == 2
    index.check_invariants()
    clock.t += 1.9
    assert index.match([a, b, c]) == {"r0": 3}
    clock.t += 0.1
    assert index.match([a, b, c]) == {"r0": 1}
    assert index.num_predicted("r0") == 0 and len(index) == 1
    index.check_invariants()

    # Real events replace predictions: the stored blocks outlive the ttl.
    index.predict("r1", [a, b, c], ttl_s=2.0)
    feed(index, "r1", stored([a, b]))
    clock.t += 5
    assert index.match([a, b, c]) == {"r0": 1, "r1": 2}
    assert index.counts("r1") == {a: 1, b: 1}
    # A remove of a predicted block, and a reset, clear predictions.
    index.predict("r1", [a, b, c, d], ttl_s=2.0)
    assert index.match([a, b, c, d]) == {"r0": 1, "r1": 4}
    feed(index, "r1", BlockRemoved([c], "GPU"))
    assert index.match([a, b, c, d]) == {"r0": 1, "r1": 2}
    feed(index, "r1", AllBlocksCleared())
    assert index.match([a, b, c, d]) == {"r0": 1}
    assert index.num_predicted("r1") == 0
    index.check_invariants()
    # An explicit ``now`` wins over the clock.
    index.predict("r2", [a, b], ttl_s=1.0, now=0.0)
    assert index.match([a, b], now=0.5) == {"r0": 1, "r2": 2}
    assert index.match([a, b], now=1.0) == {"r0": 1}


def test_sampled_predictions_credit_what_the_samples_prove() -> None:
    """prediction_stride 8: a routed request's samples (positions 7, 15, ... and its last
    block) stand for its whole prefix; a sibling is credited up to the last sample it
    shares, never beyond what the routed request held; random chains against a reference."""
    k = 8
    index = PrefixIndex(prediction_stride=k)
    chain = [i.to_bytes(16, "big") for i in range(1, 41)]  # 40 blocks
    assert index.predict("r0", chain, now=0.0) == 5  # 7, 15, 23, 31, 39
    assert index.match(chain, now=0.0) == {"r0": 40}
    sibling = chain[:21] + [b"x" * 16] * 5  # diverges at block 21
    assert index.match(sibling, now=0.0) == {"r0": 16}  # loses 5 (< k) blocks of credit
    assert index.match(chain[:21], now=0.0) == {"r0": 16}  # its last block is no sample
    assert index.match(chain[:24], now=0.0) == {"r0": 24}
    assert index.predict("r1", chain[:19], now=0.0) == 3  # 7, 15 and its last, 18
    assert index.match(chain[:19], now=0.0) == {"r0": 16, "r1": 19}
    index.check_invariants()

    rng = random.Random(5)
    for _ in range(200):
        index = PrefixIndex(prediction_stride=k)
        base = [rng.randbytes(16) for _ in range(rng.randint(1, 40))]
        routed: dict[str, list[list[bytes]]] = {}
        for r in ("a", "b", "c"):
            for _ in range(rng.randint(0, 2)):
                req = base[: rng.randint(1, len(base))] + [rng.randbytes(16)] * rng.randint(0, 3)
                routed.setdefault(r, []).append(req)
                index.predict(r, req, now=0.0)
        held = {r: {h for req in reqs for h in req} for r, reqs in routed.items()}
        probe = base[: rng.randint(1, len(base))]
        assert index.match(probe, now=0.0) == reference_sampled(held, routed, probe, k)
        # Sound: never more than a routed request of that replica really shared.
        for r, n in index.match(probe, now=0.0).items():
            assert all(h in held[r] for h in probe[:n])


def reference_sampled(
    held: dict[str, set], routed: dict[str, list[list[bytes]]], probe: list[bytes], k: int
) -> dict[str, int]:
    """Leading blocks credited per replica: block i counts when the probe's sample at or
    after i (or its last block) is among the replica's requests' samples."""
    out = {}
    for r, reqs in routed.items():
        samples = {
            req[p] for req in reqs for p in range(len(req)) if (p + 1) % k == 0 or p == len(req) - 1
        }
        n = 0
        while n < len(probe) and probe[min(n + k - 1 - n % k, len(probe) - 1)] in samples:
            n += 1
        if n:
            out[r] = n
    return out


def test_export_is_json_with_parents_and_depths() -> None:
    index = PrefixIndex()
    chain = [i.to_bytes(16, "big") for i in range(1, 601)]  # longer than one lock chunk
    feed(index, "r0", stored(chain[:300]), stored(chain[300:], chain[299]))
    side = b"\xee" * 16
    feed(index, "r0", stored([side], chain[9]))
    late, lost = b"\xdd" * 16, b"\xcc" * 16
    feed(index, "r0", stored([late], lost))  # an orphan: its parent is not known yet
    out = json.loads(json.dumps(index.export("r0")))
    by = {n["hash"]: n for n in out["nodes"]}
    assert out["num_blocks"] == 602 and out["num_tokens"] == 602 * BS
    assert by[chain[0].hex()]["parent"] is None and by[chain[0].hex()]["depth"] == 0
    for i in range(1, 600):
        assert by[chain[i].hex()]["parent"] == chain[i - 1].hex()
        assert by[chain[i].hex()]["depth"] == i
    assert by[side.hex()]["depth"] == 10 and by[side.hex()]["tokens"] == BS
    assert by[late.hex()]["depth"] is None
    feed(index, "r1", stored([lost], chain[2]))  # the parent appears: the orphan attaches
    assert {n["hash"]: n["depth"] for n in index.export("r0")["nodes"]}[late.hex()] == 4
    index.check_invariants()
    feed(index, "r1", BlockRemoved([lost], "GPU"))  # and detaches again, keeping its depth
    assert {n["hash"]: n["depth"] for n in index.export("r0")["nodes"]}[late.hex()] == 4
    index.check_invariants()
    with pytest.raises(KeyError):
        index.export("nobody")


def test_int_hashes_work_like_bytes() -> None:
    index = PrefixIndex()
    chain = [0, 1, 2**63, 2**64 - 1]  # vLLM's uint64 form, 0 included
    feed(index, "r0", stored(chain), stored([0]))
    feed(index, "r1", stored(chain[:2]))
    assert index.match(chain) == {"r0": 4, "r1": 2}
    feed(index, "r0", BlockRemoved([0], "GPU"))
    assert index.match(chain) == {"r0": 4, "r1": 2}  # one copy of 0 is left
    out = json.loads(json.dumps(index.export("r0")))
    assert [(n["hash"], n["parent"], n["depth"]) for n in out["nodes"]] == [
        (0, None, 0),
        (1, 0, 1),
        (2**63, 1, 2),
        (2**64 - 1, 2**63, 3),
    ]
    index.check_invariants()


def test_bogus_parent_cycles_do_not_hang() -> None:
    index = PrefixIndex()
    a, b = b"\x0a" * 16, b"\x0b" * 16
    feed(index, "r0", stored([a], b), stored([b], a), stored([a], a))
    assert index.match([a, b]) == {"r0": 2}
    assert index.parent_conflicts >= 1


def test_match_while_events_apply_on_another_thread() -> None:
    index, fleet, rng = PrefixIndex(), Fleet(2, seed=500), random.Random(5)
    for _ in range(50):
        fleet.step(index)
    chains, stop, errors = fleet.chains(rng), threading.Event(), []

    def reader() -> None:
        try:
            while not stop.is_set():
                for c in chains:
                    index.predict("r9", c[:1], now=0.0)
                    assert all(0 < n <= len(c) for n in index.match(c, now=0.0).values())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(300):
            fleet.step(index)
    finally:
        stop.set()
        t.join(10)
    assert not errors
    for rid, truth in fleet.truths().items():
        assert index.counts(rid) == dict(truth)
    index.check_invariants()


def test_end_to_end_over_zeromq() -> None:
    fleet, rng = Fleet(3, seed=600, clear_every=97), random.Random(6)
    index = PrefixIndex()
    pubs = {
        rid: ZmqEventPublisher(LOCAL, LOCAL, topic=rid, heartbeat_interval=0.05)
        for rid in fleet.churns
    }
    sub = ZmqEventSubscriber(on_batch=index.on_batch)
    try:
        for _ in range(100):  # r2 publishes before anyone listens: it arrives as a snapshot
            pubs["r2"].publish(fleet.step(only="r2")["r2"])
        for rid, pub in pubs.items():
            sub.add_publisher(rid, pub.endpoint, pub.replay_endpoint, rid)
        for i in range(400):
            for rid, events in fleet.step().items():
                pubs[rid].publish(events)
            if i % 50 == 0:
                time.sleep(0.001)  # let the publisher threads have the GIL
                index.match(rng.choice(fleet.chains(rng, 1)))  # reads race with the stream

        def synced() -> bool:
            return all(index.counts(r) == dict(t) for r, t in fleet.truths().items())

        assert poll(synced, timeout=30), {r: s.last_seq for r, s in sub.stats().items()}
        assert sub.stats()["r2"].snapshots >= 1
        truths = fleet.truths()
        index.check_invariants()
        for chain in fleet.chains(rng):
            assert index.match(chain) == brute_match(truths, chain)
    finally:
        sub.close()
        for pub in pubs.values():
            pub.close()


def test_match_stops_when_no_replica_is_left() -> None:
    index = PrefixIndex()
    chain = [bytes([i]) * 16 for i in range(1, 101)]
    feed(index, "r0", stored(chain[:3]))
    feed(index, "r1", stored(chain[:2]))

    class CountingDict(dict):
        lookups = 0

        def get(self, key, default=None):
            CountingDict.lookups += 1
            return super().get(key, default)

    index._masks = CountingDict(index._masks)  # white box: count the walk's lookups
    assert index.match(chain) == {"r0": 3, "r1": 2}
    assert CountingDict.lookups == 4
    CountingDict.lookups = 0
    assert index.match([b"\x00" * 16, *chain]) == {}
    assert CountingDict.lookups == 1


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


def test_index_adds_no_work_to_the_garbage_collector() -> None:
    """A full collection follows every reference of every tracked container. CPython tracks
    any OrderedDict, set or list, and only those dicts that hold a tracked object: per-block
    containers of the tracked kind (an OrderedDict LRU, a set of children per fork) made a
    1 M-block index cost ~120 ms per full collection. The index's stay untracked, so what it
    adds to a collection does not grow with its size."""

    def referents() -> int:
        gc.collect()
        return sum(len(gc.get_referents(o)) for o in gc.get_objects())

    base = referents()
    indexes = [PrefixIndex(max_blocks_per_replica=3000) for _ in range(2)]
    rng = random.Random(9)
    for index, form in zip(indexes, ["bytes", "int"], strict=True):
        x = (lambda i: i.to_bytes(16, "big")) if form == "bytes" else (lambda i: i)
        for k, rid in enumerate(("r0", "r1", "r2")):
            for c in range(60):  # 60 chains of 64 under one shared root: forks and evictions
                chain = [x(10_000_000 * (k + 1) + 100_000 * c + i) for i in range(64)]
                feed(index, rid, stored([x(1)]), stored(chain, x(1)), stored(chain[:2], x(1)))
                feed(index, rid, BlockRemoved(chain[10:12], "GPU"))  # orphans their children
            index.predict(rid, [x(7_000_000 + i) for i in range(50)], now=0.0)
            for _ in range(40):  # single-block roots, some stored twice: copies
                feed(index, rid, stored([x(9_000_000 + rng.randrange(30))]))
        index.check_invariants()
        assert len(index) > 8000 and index._orphans
    added = referents() - base
    assert added < 500, added  # vs > 2 per block (9,000+ blocks here) when tracked
