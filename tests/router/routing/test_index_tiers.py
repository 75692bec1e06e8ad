"""PrefixIndex with lower KV tiers: a device hit and the lower-tier extension beyond it,
removes per medium, unknown media never device hits, vLLM's placeholder events, clears and
replica removal, random churn against a brute-force reference, and a subscriber's view over
real ZeroMQ sockets (lossy path, snapshots) equal to the engine's, tier by tier."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence

import msgspec
import pytest

from kvroute.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    decode_batch,
)
from kvroute.events.transport import ZmqEventSubscriber
from kvroute.router.routing.index import PrefixIndex, TierMatch

from ...events.transport.streams import BS, LossyProxy, publisher
from ...waiting import poll

LOWER = ("CPU", "STORAGE", "lmcache-disk")  # fastest first, as the index ranks them


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def stored(hashes: Sequence[bytes], parent=None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(list(hashes), parent, [1] * (BS * len(hashes)), BS, None, medium, None)


def placeholder(x: bytes | int, medium: str = "CPU") -> BlockStored:
    """vLLM's offloading connector without metadata: one hash, no parent, no tokens."""
    return BlockStored([x], None, [], 0, None, medium, None)


def feed(index: PrefixIndex, rid: str, *events: KVCacheEvent) -> None:
    index.apply(rid, EventBatch(0.0, list(events)))


CHAIN = [h(i) for i in range(1, 11)]


def test_a_device_hit_and_the_lower_tier_extension_beyond_it() -> None:
    index = PrefixIndex()
    feed(index, "r0", stored(CHAIN[:3]), stored(CHAIN[:6], medium="CPU"))
    feed(index, "r1", stored(CHAIN[:5], medium="CPU"), stored(CHAIN[5:8], CHAIN[4], "STORAGE"))
    feed(index, "r2", stored(CHAIN[:2]))
    # the device's alone: a lower-tier copy is never a device hit
    assert index.match(CHAIN) == {"r0": 3, "r2": 2}
    assert index.match_tiers(CHAIN) == {
        "r0": TierMatch(3, (("CPU", 3),)),
        "r1": TierMatch(0, (("CPU", 5), ("STORAGE", 3))),
        "r2": TierMatch(2),
    }
    assert index.match_tiers(CHAIN)["r1"].blocks == 8
    # a block held in both lower tiers counts once, in the faster
    feed(index, "r1", stored(CHAIN[:8], medium="STORAGE"))
    assert index.match_tiers(CHAIN)["r1"] == TierMatch(0, (("CPU", 5), ("STORAGE", 3)))
    assert index.num_blocks("r1") == 0 and index.num_blocks("r1", "STORAGE") == 8
    assert index.tiers() == ["CPU", "STORAGE"]
    assert index.export("r1")["tiers"] == {"CPU": 5, "STORAGE": 8}
    index.check_invariants()


def test_extension_stops_at_a_block_no_lower_tier_holds() -> None:
    index = PrefixIndex()
    feed(index, "r0", stored(CHAIN[:2]), stored(CHAIN[6:9], CHAIN[5]))  # device, a gap
    feed(index, "r0", stored(CHAIN[2:4], CHAIN[1], "CPU"), stored(CHAIN[5:7], CHAIN[4], "CPU"))
    # device 0-1, host 2-3, then block 4 nowhere: the host's 5-6 and the device's 6-8 are
    # past a recompute, so not part of the hit
    assert index.match_tiers(CHAIN) == {"r0": TierMatch(2, (("CPU", 2),))}


def test_a_remove_takes_its_own_tiers_copy_alone() -> None:
    index = PrefixIndex()
    feed(index, "r0", stored(CHAIN[:4]), stored(CHAIN[:4], medium="CPU"))
    feed(index, "r0", BlockRemoved(CHAIN[2:4], "CPU"))  # the host dropped its copies
    assert index.match_tiers(CHAIN) == {"r0": TierMatch(4)}
    feed(index, "r0", BlockRemoved(CHAIN[1:4], "GPU"))  # the device evicted its tail
    assert index.match_tiers(CHAIN) == {"r0": TierMatch(1, (("CPU", 1),))}
    assert index.counts("r0", "CPU") == {CHAIN[0]: 1, CHAIN[1]: 1}
    # a remove of a copy a tier never held is counted, and changes nothing
    feed(index, "r0", BlockRemoved([CHAIN[0]], "STORAGE"), BlockRemoved([CHAIN[9]], "CPU"))
    assert index.match_tiers(CHAIN) == {"r0": TierMatch(1, (("CPU", 1),))}
    assert index.export("r0")["unknown_removals"] == 2
    index.check_invariants()


def test_an_unknown_medium_is_never_a_device_hit() -> None:
    index = PrefixIndex()
    feed(index, "r0", stored(CHAIN[:3], medium="lmcache-disk"))
    feed(index, "r1", stored(CHAIN[:3], medium="GPU"), stored(CHAIN[3:5], CHAIN[2], "STORAGE"))
    ev = stored(CHAIN[:5], medium="GPU")
    ev.locality = "REMOTE"  # vLLM: a copy held away from the engine is not its device's
    feed(index, "r2", ev)
    feed(index, "r3", stored(CHAIN[:2], medium="cpu"))  # LMCache's spelling of host memory
    assert index.match(CHAIN) == {"r1": 3}
    got = index.match_tiers(CHAIN)
    assert got["r0"] == TierMatch(0, (("lmcache-disk", 3),))
    assert got["r1"] == TierMatch(3, (("STORAGE", 2),))
    assert got["r2"] == TierMatch(0, (("GPU@REMOTE", 5),))
    assert got["r3"] == TierMatch(0, (("CPU", 2),))
    index.check_invariants()


def test_vllm_placeholder_events_decode_and_are_indexed() -> None:
    """vLLM's OffloadingConnector, self-describing events off: BlockStored of one hash,
    no parent, no tokens, block_size 0, medium "CPU" (and fields kvroute does not know)."""
    x = 0xDEADBEEF
    raw = [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [7] * 16, "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockStored", "block_hashes": [x], "parent_block_hash": None,
         "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
         "lora_name": None, "group_idx": 0, "locality": "LOCAL", "ownership": None,
         "kv_cache_spec_kind": None},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
    ]  # fmt: skip
    batch = decode_batch(msgspec.msgpack.encode([time.time(), raw, None]))
    index = PrefixIndex()
    index.apply("r0", batch)
    assert index.match([x]) == {}
    assert index.match_tiers([x]) == {"r0": TierMatch(0, (("CPU", 1),))}
    index.apply("r0", decode_batch(msgspec.msgpack.encode(
        [time.time(), [{"type": "BlockRemoved", "block_hashes": [x], "medium": "CPU"}], None]
    )))  # fmt: skip
    assert index.match_tiers([x]) == {}
    index.check_invariants()


def test_clears_and_replica_removal_leave_no_stale_lower_tier_entry() -> None:
    index = PrefixIndex()
    for rid in ("r0", "r1"):
        feed(index, rid, stored(CHAIN[:2]), stored(CHAIN[:6], medium="CPU"))
    feed(index, "r0", stored(CHAIN[:7], medium="STORAGE"))
    feed(index, "r0", AllBlocksCleared())  # a restart, or a reset: every tier goes
    assert index.match_tiers(CHAIN) == {"r1": TierMatch(2, (("CPU", 4),))}
    assert index.num_blocks("r0", "CPU") == index.num_blocks("r0", "STORAGE") == 0
    feed(index, "r0", stored(CHAIN[:6], medium="CPU"))
    assert index.drop_replica("r1")
    assert index.match_tiers(CHAIN) == {"r0": TierMatch(0, (("CPU", 6),))}
    assert index.drop_replica("r0")
    assert index.match_tiers(CHAIN) == {} and index.num_blocks("r0", "CPU") == 0
    # a replica that joins later takes a freed bit: no tier may credit it the old holdings
    feed(index, "r9", stored(CHAIN[:1]))
    assert index.match_tiers(CHAIN) == {"r9": TierMatch(1)}
    index.check_invariants()


def test_a_long_lower_tier_event_is_applied_in_chunks() -> None:
    chain = [h(i) for i in range(1, 1001)]
    index = PrefixIndex()
    feed(index, "r0", stored(chain[:10]), stored(chain, medium="CPU"))
    assert index.match_tiers(chain) == {"r0": TierMatch(10, (("CPU", 990),))}
    feed(index, "r0", BlockRemoved(chain[500:], "CPU"))
    assert index.match_tiers(chain) == {"r0": TierMatch(10, (("CPU", 490),))}
    index.check_invariants()


# -- random churn against a brute-force reference ------------------------------------------
class TieredChurn:
    """An engine with a device pool and lower tiers: chains stored on the device, copies
    moved down to lower tiers (some as vLLM-style placeholders), removes per tier, rare
    clears; the true copies per tier kept independently of any kvroute code."""

    def __init__(self, seed: int, clear_every: int = 0, lower: tuple[str, ...] = LOWER) -> None:
        self.rng = random.Random(seed)
        self.lower = lower
        self.truth: dict[str, Counter[bytes]] = {t: Counter() for t in ("GPU", *lower)}
        self.parents: dict[bytes, bytes | None] = {}
        self.next_id = 0
        self.clear_every, self.steps = clear_every, 0

    def step(self) -> list[KVCacheEvent]:
        self.steps += 1
        rng, events, truth = self.rng, [], self.truth
        if self.clear_every and self.steps % self.clear_every == 0:
            for c in truth.values():
                c.clear()
            return [AllBlocksCleared()]
        for _ in range(rng.randint(1, 6)):
            r = rng.random()
            known = list(self.parents)
            if r < 0.35 or not known:
                parent = rng.choice(known) if known and rng.random() < 0.7 else None
                hs = []
                for _ in range(rng.randint(1, 4)):
                    self.next_id += 1
                    hs.append(h(self.next_id))
                    self.parents[hs[-1]] = parent if not hs[:-1] else hs[-2]
                events.append(stored(hs, parent))
                truth["GPU"].update(hs)
            elif r < 0.65:  # copies of known blocks into a lower tier
                tier = rng.choice(self.lower)
                x = rng.choice(known)
                if tier == "CPU" and rng.random() < 0.5:
                    events.append(placeholder(x))
                    truth[tier][x] += 1
                    continue
                xs = [x]  # x and up to 3 of its ancestors, as a chain
                while len(xs) < 4 and (p := self.parents[xs[-1]]) is not None:
                    xs.append(p)
                xs.reverse()
                events.append(stored(xs, self.parents[xs[0]], tier))
                truth[tier].update(xs)
            else:  # removes in one tier, the device's most often
                tier = rng.choice(("GPU", "GPU", "GPU", *self.lower))
                held = list(truth[tier])
                if not held:
                    continue
                xs = rng.sample(held, rng.randint(1, min(3 if tier == "GPU" else 1, len(held))))
                events.append(BlockRemoved(xs, tier))
                for x in xs:
                    truth[tier][x] -= 1
                    if not truth[tier][x]:
                        del truth[tier][x]
        return events

    def chains(self, k: int) -> list[list[bytes]]:
        out = []
        for _ in range(k):
            chain = [self.rng.choice(list(self.parents))]
            while (p := self.parents[chain[-1]]) is not None:
                chain.append(p)
            out.append(chain[::-1])
        return out


def brute(truths: dict[str, dict[str, Counter]], chain: list[bytes]) -> dict[str, TierMatch]:
    out = {}
    for rid, t in truths.items():
        d = 0
        while d < len(chain) and t["GPU"][chain[d]] > 0:
            d += 1
        ext: dict[str, int] = {}
        i = d
        while i < len(chain):
            tier = next((x for x in LOWER if x in t and t[x][chain[i]] > 0), None)
            if tier is None:
                break
            ext[tier] = ext.get(tier, 0) + 1
            i += 1
        if i:
            out[rid] = TierMatch(d, tuple((x, ext[x]) for x in LOWER if x in ext))
    return out


def assert_index_equals(index: PrefixIndex, churns: dict[str, TieredChurn]) -> None:
    for rid, churn in churns.items():
        for tier, truth in churn.truth.items():
            assert index.counts(rid, tier) == dict(+truth), (rid, tier)
    index.check_invariants()
    truths = {rid: c.truth for rid, c in churns.items()}
    for churn in churns.values():
        for chain in churn.chains(50):
            assert index.match_tiers(chain) == brute(truths, chain), chain
            assert index.match(chain) == {r: m.device for r, m in brute(truths, chain).items()
                                          if m.device}  # fmt: skip


@pytest.mark.parametrize("lower", [LOWER, ("CPU",)], ids=["three-tiers", "host-only"])
def test_random_tiered_churn_matches_a_brute_force_reference(lower: tuple[str, ...]) -> None:
    """Three lower tiers walk the general path; a host tier alone, the run-length one."""
    index = PrefixIndex()
    churns = {
        f"r{i}": TieredChurn(seed=70 + i, clear_every=53 + 7 * i, lower=lower) for i in range(3)
    }
    shared = churns["r0"]  # replicas store the same chains: hashes and tiers overlap
    for c in churns.values():
        c.parents = shared.parents
    for step in range(600):
        for rid, c in churns.items():
            c.next_id = max(x.next_id for x in churns.values())
            feed(index, rid, *c.step())
        if step % 100 == 99:
            assert_index_equals(index, churns)
    index.drop_replica("r1")
    del churns["r1"]
    assert_index_equals(index, churns)


def test_subscriber_rebuilds_every_tier_over_a_lossy_path_and_a_snapshot() -> None:
    """Real sockets: a publisher whose engine moves blocks between tiers, a proxy dropping
    5% of its messages, a subscriber feeding the index. Gaps are replayed; a late joiner
    gets a snapshot; both end equal to the engine, tier by tier."""
    churn = TieredChurn(seed=5)
    pub = publisher(topic="r0", buffer_steps=50)
    rng = random.Random(3)
    proxy = LossyProxy(pub.endpoint, lambda f: None if rng.random() < 0.05 else f)
    lossy, late = PrefixIndex(), PrefixIndex()
    subs = [ZmqEventSubscriber(on_batch=lossy.on_batch), ZmqEventSubscriber(on_batch=late.on_batch)]

    def synced(index: PrefixIndex) -> bool:
        return all(index.counts("r0", t) == dict(+truth) for t, truth in churn.truth.items())

    def run(steps: int) -> None:
        for _ in range(steps):
            pub.publish(churn.step())
            time.sleep(0.0001)

    try:
        subs[0].add_publisher("r0", proxy.endpoint, pub.replay_endpoint, "r0")
        run(1500)
        # joins with the stream half done: a snapshot brings every tier up at once
        subs[1].add_publisher("r0", pub.endpoint, pub.replay_endpoint, "r0")
        for _ in range(2):
            for index, sub in zip((lossy, late), subs, strict=True):
                assert poll(lambda i=index: synced(i), timeout=60), sub.stats()
                assert_index_equals(index, {"r0": churn})
            run(1500)
        assert proxy.dropped > 50 and subs[0].stats()["r0"].replays > 0
        assert subs[1].stats()["r0"].snapshots >= 1
        assert len(churn.truth["CPU"]) > 20 and len(churn.truth["STORAGE"]) > 20
        for t, truth in churn.truth.items():  # the publisher's ledger, tier by tier
            assert pub.state.counts(t) == dict(+truth)
    finally:
        for sub in subs:
            sub.close()
        proxy.close()
        pub.close()
