"""Lower KV tiers in the event contract: medium names, vLLM's placeholder events, a block set
and its snapshot kept per tier, and token-id translation that never lets one tier's remove
take another tier's copy."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvroute.events import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockSet,
    BlockStored,
    EventBatch,
    MalformedBatchError,
    decode_batch,
    encode_batch,
    snapshot_events,
    tier_name,
)
from kvroute.events.translate import EventTranslator

BS = 4


def test_tier_names():
    assert tier_name(None) == tier_name("GPU") == "GPU"
    assert tier_name("cpu") == "CPU" and tier_name("Storage") == "STORAGE"
    assert tier_name("GPU", "REMOTE") == "GPU@REMOTE"  # never the device's
    assert tier_name("STORAGE", "remote") == "STORAGE@REMOTE"
    assert tier_name("CPU", "LOCAL") == "CPU"
    assert tier_name("lmcache-disk") == "lmcache-disk"


def test_placeholders_decode_and_round_trip_but_tokens_without_a_size_do_not():
    ph = BlockStored([5], None, [], 0, None, "CPU", None, None, 0, "LOCAL")
    batch = decode_batch(encode_batch(EventBatch(1.0, [ph, BlockRemoved([5], "CPU")])))
    assert batch.events[0] == ph and batch.events[1].medium == "CPU"
    bad = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
           "token_ids": [1, 2], "block_size": 0, "lora_id": None, "medium": "CPU",
           "lora_name": None}  # fmt: skip
    with pytest.raises(MalformedBatchError):
        decode_batch(msgspec.msgpack.encode([time.time(), [bad], None]))


def stored(hashes: list, medium: str | None = "GPU", parent=None) -> BlockStored:
    return BlockStored(hashes, parent, [1] * (BS * len(hashes)), BS, None, medium, None)


def test_a_block_set_keeps_copies_per_tier_and_its_snapshot_gives_every_tier_back():
    s = BlockSet()
    s.apply_batch(EventBatch(0.0, [
        stored([b"a", b"b"]), stored([b"a", b"b", b"c"], "CPU"), stored([b"c"], "cpu"),
        BlockStored([b"d"], None, [], 0, None, "CPU", None), stored([b"a"], "STORAGE"),
        BlockRemoved([b"b"], "GPU"), BlockRemoved([b"a"], "CPU"), BlockRemoved([b"z"], "CPU"),
    ]))  # fmt: skip
    assert s.counts() == {b"a": 1}  # the device's: a CPU remove took nothing from it
    assert s.counts("CPU") == {b"b": 1, b"c": 2, b"d": 1}
    assert s.counts("STORAGE") == {b"a": 1} and s.unknown_removals == 1
    assert sorted(s.tiers()) == ["CPU", "STORAGE"]
    copy = BlockSet()
    copy.apply_batch(EventBatch(0.0, snapshot_events(s.records(), *s.tier_records().values())))
    for tier in ("GPU", "CPU", "STORAGE"):
        assert copy.counts(tier) == s.counts(tier)
    s.apply(AllBlocksCleared())
    assert not s.counts() and not s.tiers()


def test_translation_keeps_each_tiers_copies_apart():
    """A token-indexed replica (vLLM's pickle sha256): the device stores a chain; the
    offloading connector stores placeholders (untranslatable: no tokens) and
    self-describing copies, then removes them. No lower-tier remove may take the
    device's copy: the device's own remove must still find it."""
    hasher = BlockHasher("xxh3_128", "seed", BS)
    tr = EventTranslator(hasher)
    view = BlockSet()

    def apply(*events) -> None:
        view.apply_batch(tr.translate(EventBatch(0.0, list(events))))

    apply(BlockStored([11, 12], None, list(range(8)), BS, None, "GPU", None))
    apply(BlockStored([12], None, [], 0, None, "CPU", None))  # a placeholder: dropped
    assert tr.stats.untranslatable == 1
    apply(BlockRemoved([12], "CPU"))  # its remove: no CPU copy mapped, so dropped
    assert tr.stats.unknown_removals == 1 and len(view.counts()) == 2
    apply(BlockStored([11], None, list(range(4)), BS, None, "CPU", None))  # self-describing
    assert len(view.counts("CPU")) == 1
    apply(BlockRemoved([11, 12], "GPU"))
    assert view.counts() == {} and len(view.counts("CPU")) == 1  # the host copy stays
    assert tr.fleet_hash(11) is not None and tr.fleet_hash(12) is None
    apply(BlockRemoved([11], "CPU"))
    assert view.counts("CPU") == {} and len(tr) == 0


def test_the_translators_bound_forgets_copies_in_their_own_tiers():
    hasher = BlockHasher("xxh3_128", "seed", BS)
    tr = EventTranslator(hasher, max_entries=2)
    view = BlockSet()
    for events in (
        [BlockStored([1], None, [1] * BS, BS, None, "GPU", None)],
        [BlockStored([1], None, [1] * BS, BS, None, "CPU", None)],
        [BlockStored([2, 3], 1, [2] * 2 * BS, BS, None, "GPU", None)],  # forgets hash 1
    ):
        view.apply_batch(tr.translate(EventBatch(0.0, events)))
    assert len(view.counts()) == 2 and view.counts("CPU") == {} and view.unknown_removals == 0
