"""Token-id indexing (events/translate.py): a vLLM ``sha256`` engine's events, re-hashed with
the fleet's hasher, rebuild exactly what kvroute-hashed events of the same cache rebuild.

Each test drives one cache (tests/events/twin.py) that tells every change twice -- once in
kvroute's hashes, once as vLLM with its pickle-based ``sha256`` -- and compares the block
sets (counts and parent links) built from the kvroute stream and from the translated one.
"""

from __future__ import annotations

import random

import pytest

from kvroute.events import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockSet,
    BlockStored,
    EventBatch,
    snapshot_events,
    to_external,
)
from kvroute.events.translate import EventTranslator, from_vllm_hash_algo, reproducible

from .twin import TwinCache, reachable, vllm_sha256_hashes

BS = 4
SALTS = {"salted": ["a" * 64, "b" * 64 + ":req", None], "unsalted": [None]}
FLEETS = [("xxh3_128", "bytes"), ("sha256_cbor_tagged", "int")]


def parents(view: BlockSet) -> dict:
    return {h: r.parent for h, r in view.records().items()}


class Pair:
    """The kvroute-hashed view and the translated view of one twin cache."""

    def __init__(self, algo: str, form: str, seed: int = 0, max_entries: int = 1_000_000):
        self.hasher = BlockHasher(algo, "fleet-seed", BS)
        self.twin = TwinCache(self.hasher, form, seed)  # type: ignore[arg-type]
        self.tr = EventTranslator(self.hasher, form, max_entries)  # type: ignore[arg-type]
        self.kv, self.translated = BlockSet(), BlockSet()
        self.engine = BlockSet()  # the vLLM stream as it is (what its publisher would hold)

    def apply(self, kv_events: list, vllm_events: list) -> None:
        self.kv.apply_batch(EventBatch(0.0, kv_events))
        self.engine.apply_batch(EventBatch(0.0, vllm_events))
        self.translated.apply_batch(self.tr.translate(EventBatch(0.0, vllm_events)))


@pytest.mark.parametrize("algo,form", FLEETS)
@pytest.mark.parametrize("salts", SALTS.values(), ids=list(SALTS))
def test_translated_stream_rebuilds_the_kvroute_hashed_one(algo, form, salts):
    """Stores, extra copies, evictions (parents before children too) and clears."""
    p = Pair(algo, form, seed=7)
    for _ in range(600):
        p.apply(*p.twin.step(salts))
        assert p.translated.counts() == p.kv.counts()
        assert parents(p.translated) == parents(p.kv)
        assert len(p.tr) == len(p.twin.held)  # one map entry per engine hash held
    st = p.tr.stats
    assert st.unknown_removals == st.unknown_parents == st.conflicts == st.forgotten == 0
    assert st.stored > 200 and st.removed > 50


@pytest.mark.parametrize("salt", ["t" * 64, None])
def test_the_requests_hashes_hit_what_the_engine_holds(salt):
    """A prompt the engine holds whole is found whole under the hashes the router computes
    for it (its salt on block 0), and under no other salt."""
    p = Pair("xxh3_128", "bytes", seed=3)
    tokens = list(range(100, 100 + 5 * BS + 3))  # 5 full blocks and a partial one
    p.apply(*p.twin.store(tokens, salt))
    routed = p.hasher.hash_blocks(tokens, cache_salt=salt)
    assert all(p.translated.count(h) == 1 for h in routed)
    other = p.hasher.hash_blocks(tokens, cache_salt="x" * 64)
    assert not any(h in p.translated for h in other)


def test_a_removal_of_an_unknown_engine_hash_is_counted_not_fatal():
    p = Pair("xxh3_128", "bytes")
    out = p.tr.translate(EventBatch(0.0, [BlockRemoved([123, 456], "GPU")]))
    assert out.events == [] and p.tr.stats.unknown_removals == 2


def test_a_store_under_an_unknown_parent_is_dropped_and_its_removal_counted():
    """Stored before this subscriber listened: the chain cannot be hashed without its
    parent's fleet digest, so the blocks are missing (fewer hits), never wrong."""
    p = Pair("xxh3_128", "bytes")
    tokens = list(range(3 * BS))
    vl = vllm_sha256_hashes(tokens, BS, None)
    late = BlockStored(vl[1:], vl[0], tokens[BS:], BS, None, "GPU", None, [None, None])
    assert p.tr.translate(EventBatch(0.0, [late])).events == []
    assert p.tr.stats.unknown_parents == 2
    assert p.tr.translate(EventBatch(0.0, [BlockRemoved(vl[1:], "GPU")])).events == []
    assert p.tr.stats.unknown_removals == 2


def test_the_map_is_bounded_and_what_it_forgets_the_index_forgets():
    """With room for 12 engine hashes: never more entries; the translated view only ever
    holds what the engine holds (an under-approximation, counts included)."""
    p = Pair("xxh3_128", "bytes", seed=11, max_entries=12)
    for _ in range(500):
        p.apply(*p.twin.step(SALTS["salted"]))
        assert len(p.tr) <= 12
        kv = p.kv.counts()
        assert all(kv.get(h, 0) >= c for h, c in p.translated.counts().items())
        assert len(p.translated) <= 12
    assert p.tr.stats.forgotten > 0


def test_all_blocks_cleared_empties_the_map():
    p = Pair("xxh3_128", "bytes")
    p.apply(*p.twin.store(list(range(3 * BS)), "s" * 64))
    assert len(p.tr) == 3
    p.apply(*p.twin.clear())
    assert len(p.tr) == 0 and len(p.translated) == 0
    p.tr.clear()  # and the front door's own clear (a dropped replica)
    assert len(p.tr) == 0


@pytest.mark.parametrize("salts", SALTS.values(), ids=list(SALTS))
def test_a_late_join_by_snapshot_rebuilds_it_whatever_the_order(salts):
    """A snapshot (one BlockStored per copy, each with its parent and its block's extra
    keys) in shuffled chunks: children before their parents wait for them. A block whose
    parent the engine evicted cannot be re-hashed from a snapshot (its parent's tokens are
    gone) and cannot be hit either: the rebuilt view is every block a request can hit."""
    p = Pair("xxh3_128", "bytes", seed=5)
    for _ in range(300):
        p.apply(*p.twin.step(salts))
    events = snapshot_events(p.engine.records())
    random.Random(1).shuffle(events)
    late, view = EventTranslator(p.hasher, "bytes"), BlockSet()
    chunks = [events[i : i + 7] for i in range(0, len(events), 7)]
    chunks[0] = [AllBlocksCleared(), *chunks[0]]
    for chunk in chunks:
        view.apply_batch(late.translate(EventBatch(0.0, chunk), snapshot=True))
    want = reachable(p.engine, p.twin.kv_of)
    assert view.counts() == want
    broken = sum(p.engine.counts().values()) - sum(want.values())
    assert broken > 0  # the run did evict parents of held blocks
    late.translate(EventBatch(0.0, []))  # live again: the snapshot is over
    assert late.stats.unknown_parents == broken
    # Then live: the stream goes on from there, never holding what the engine does not.
    for _ in range(100):
        kv_events, vllm_events = p.twin.step(salts)
        p.kv.apply_batch(EventBatch(0.0, kv_events))
        view.apply_batch(late.translate(EventBatch(0.0, vllm_events)))
        kv = p.kv.counts()
        assert all(kv.get(h, 0) >= c for h, c in view.counts().items())


def test_a_snapshot_orphan_whose_parent_never_comes_is_dropped_when_it_ends():
    p = Pair("xxh3_128", "bytes")
    tokens = list(range(2 * BS))
    vl = vllm_sha256_hashes(tokens, BS, None)
    orphan = BlockStored([vl[1]], vl[0], tokens[BS:], BS, None, "GPU", None)
    assert p.tr.translate(EventBatch(0.0, [orphan]), snapshot=True).events == []
    assert p.tr.stats.unknown_parents == 0  # it may still come
    p.tr.translate(EventBatch(0.0, []))  # a live batch: the snapshot is over
    assert p.tr.stats.unknown_parents == 1
    root = BlockStored([vl[0]], None, tokens[:BS], BS, None, "GPU", None)
    out = p.tr.translate(EventBatch(0.0, [root]))
    assert [len(e.block_hashes) for e in out.events] == [1]  # the orphan is gone for good


def test_lora_and_salt_keys_hash_as_the_router_hashes_a_lora_request():
    """vLLM publishes ``[lora_name, salt]`` on block 0 and ``[lora_name]`` after it."""
    hasher = BlockHasher("xxh3_128", "s", BS)
    tr = EventTranslator(hasher)
    tokens = list(range(2 * BS))
    ev = BlockStored([1, 2], None, tokens, BS, 7, "GPU", "ad", [["ad", "salt"], ["ad"]])
    (out,) = tr.translate(EventBatch(0.0, [ev])).events
    assert out.block_hashes == hasher.hash_blocks(tokens, cache_salt="salt", lora_name="ad")


def test_other_extra_keys_are_indexed_consistently_and_match_no_text_request():
    """A multimodal key on block 1: its blocks differ from the same tokens without it, and
    its removal finds them."""
    hasher = BlockHasher("xxh3_128", "s", BS)
    tr, view = EventTranslator(hasher), BlockSet()
    tokens = list(range(3 * BS))
    keys = [None, [["img-0", 0]], None]
    ev = BlockStored([1, 2, 3], None, tokens, BS, None, "GPU", None, keys)
    view.apply_batch(tr.translate(EventBatch(0.0, [ev])))
    plain = hasher.hash_blocks(tokens)
    assert plain[0] in view and plain[1] not in view and plain[2] not in view
    assert len(view) == 3
    view.apply_batch(tr.translate(EventBatch(0.0, [BlockRemoved([1, 2, 3], "GPU")])))
    assert len(view) == 0 and len(tr) == 0


def test_events_of_another_block_size_are_not_translated():
    """vLLM's optional partial-block events: the router never hashes such a block."""
    tr = EventTranslator(BlockHasher("xxh3_128", "s", BS))
    partial = BlockStored([9], None, [1, 2], 2, None, "GPU", None)
    assert tr.translate(EventBatch(0.0, [partial])).events == []
    assert tr.stats.untranslatable == 1


def test_outputs_are_in_the_fleet_form():
    hasher = BlockHasher("sha256_cbor_tagged", "vllm-none-hash", BS)
    tr = EventTranslator(hasher, "int")
    tokens = list(range(2 * BS))
    ev = BlockStored([5, 6], None, tokens, BS, None, "GPU", None, [["salt"], None])
    (out,) = tr.translate(EventBatch(0.0, [ev])).events
    want = [to_external(h, "int") for h in hasher.hash_blocks(tokens, cache_salt="salt")]
    assert out.block_hashes == want and tr.fleet_hash(6) == want[1]


def test_which_algorithms_are_indexed_by_token_ids():
    assert from_vllm_hash_algo("sha256_cbor") == "sha256_cbor_tagged"
    assert from_vllm_hash_algo("sha256") == "vllm:sha256"
    assert from_vllm_hash_algo("xxhash") == "vllm:xxhash"  # random seed per process
    assert reproducible("xxh3_128") and reproducible("sha256_cbor_tagged")
    assert not reproducible("vllm:sha256")
