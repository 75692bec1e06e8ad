"""PrefixIndex: exact per-replica counts under churn, leading-block matching checked against
a brute-force reference, duplicates, dropped and reset replicas, export, int hashes, and
garbage-collector silence. Eviction, predictions, threads and ZeroMQ have files of their own
(test_index_eviction.py, test_index_predictions.py, test_index_threads_and_zmq.py)."""

from __future__ import annotations

import gc
import json
import random
from collections import Counter

import pytest

from kvroute.events import AllBlocksCleared, BlockRemoved, EventBatch
from kvroute.events.transport import ReplicaBatch
from kvroute.router.routing.index import PrefixIndex

from ...events.transport.streams import BS
from .index_truth import Fleet, assert_matches_truth, brute_match, feed, stored


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
