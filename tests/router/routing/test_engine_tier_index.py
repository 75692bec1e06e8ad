"""A real engine with host and disk KV tiers, its events over real ZeroMQ, the router's
index: after lost messages (replayed) and a late join (a snapshot), the index holds what
each tier of the engine holds; a reset empties every tier; a restarted replica (same disk
folder, same endpoints) leaves no stale lower-tier entry behind (issue 38)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from kvroute.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, to_external
from kvroute.events.transport import ZmqEventPublisher, ZmqEventSubscriber
from kvroute.replica import EngineConfig, LLMEngine, SamplingParams
from kvroute.router.routing.index import PrefixIndex

from ...events.transport.streams import LossyProxy, publisher
from ...waiting import poll

RID = "r0"
BLOCK = 4
BLOCK_BYTES = 16384  # tiny, fp32
TIERS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def truth(engine: LLMEngine, tier: str) -> dict:
    """What the engine holds in ``tier``, as the index should count it."""
    pool, tiers = engine.kv_cache_manager.block_pool, engine.kv_tiers
    if tier == MEDIUM_GPU:
        return pool.cached_hash_counts()
    held = tiers.host if tier == MEDIUM_CPU else tiers.disk_meta
    return {to_external(h, pool.hash_form): 1 for h in held}


def synced(index: PrefixIndex, engine: LLMEngine) -> bool:
    return all(index.counts(RID, t) == truth(engine, t) for t in TIERS)


def serve(engine: LLMEngine, prompts: list[list[int]], tag: str) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()


def conversations(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(20, 44))] for _ in range(n)]


def tiered_engine(folder: Path, sink) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="tiny",
            block_size=BLOCK,
            num_blocks=24,
            kv_host_bytes=12 * BLOCK_BYTES,
            kv_disk_path=str(folder),
            kv_disk_bytes=40 * BLOCK_BYTES,
        ),
        event_sinks=[sink],
    )


def test_the_index_holds_every_tier_of_the_engine_after_loss_and_a_late_join(
    tmp_path: Path,
) -> None:
    pub = publisher(topic=RID, buffer_steps=10_000)
    rng = random.Random(7)
    proxy = LossyProxy(pub.endpoint, lambda f: None if rng.random() < 0.1 else f)
    lossy, late = PrefixIndex(), PrefixIndex()
    subs = [ZmqEventSubscriber(on_batch=lossy.on_batch), ZmqEventSubscriber(on_batch=late.on_batch)]
    engine = tiered_engine(tmp_path / "kv", pub.publish)
    convs = conversations(10, seed=1)
    try:
        subs[0].add_publisher(RID, proxy.endpoint, pub.replay_endpoint, RID)
        assert poll(lambda: subs[0].in_sync(RID))
        order = [rng.randrange(len(convs)) for _ in range(40)]
        serve(engine, [convs[i] for i in order[:20]], "a")
        subs[1].add_publisher(RID, pub.endpoint, pub.replay_endpoint, RID)  # joins late
        serve(engine, [convs[i] for i in order[20:]], "b")
        for index in (lossy, late):
            assert poll(lambda i=index: synced(i, engine), timeout=60), subs[0].stats()
        stats = engine.stats()
        assert stats["kv_tier_loaded"] > 0 and stats["kv_tier_spilled"] > 0
        assert truth(engine, MEDIUM_CPU) and truth(engine, MEDIUM_STORAGE)
        assert proxy.dropped > 0 and subs[0].stats()[RID].replays > 0
        assert subs[1].stats()[RID].snapshots >= 1
        # a reset clears every tier, here and in the index; the disk folder is empty
        assert engine.reset_prefix_cache()
        for index in (lossy, late):
            assert poll(lambda i=index: all(not i.counts(RID, t) for t in TIERS), timeout=30)
        assert engine.kv_tiers.disk.flush(10)  # the removals are the writer thread's
        assert not list(engine.kv_tiers.disk.path.glob("*.kvb*"))
    finally:
        for sub in subs:
            sub.close()
        proxy.close()
        pub.close()
        engine.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_replica_leaves_no_stale_lower_tier_entry(tmp_path: Path) -> None:
    """The replica's process ends and a new one starts on the same disk folder and the same
    endpoints; the subscriber sees the restart (its seq starts again) and the index ends
    equal to the new engine, which wiped the folder: nothing of the old disk tier is
    credited."""
    folder = tmp_path / "kv"
    ports = free_port(), free_port()
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    index = PrefixIndex()
    sub = ZmqEventSubscriber(on_batch=index.on_batch)
    convs = conversations(8, seed=2)
    pub = ZmqEventPublisher(*endpoints, topic=RID, heartbeat_interval=0.05)
    first = tiered_engine(folder, pub.publish)
    try:
        sub.add_publisher(RID, endpoints[0], endpoints[1], RID)
        assert poll(lambda: sub.in_sync(RID))
        serve(first, convs, "a")
        assert poll(lambda: synced(index, first), timeout=60)
        old_disk = index.counts(RID, MEDIUM_STORAGE)
        assert old_disk and list(first.kv_tiers.disk.path.glob("*.kvb"))
        pub.close()
        first.kv_tiers.disk.store.close = lambda: None  # type: ignore[method-assign]  # killed
        first.close()

        pub = ZmqEventPublisher(*endpoints, topic=RID, heartbeat_interval=0.05)
        second = tiered_engine(folder, pub.publish)
        assert not list(folder.rglob("*.kvb"))  # wiped at start
        serve(second, conversations(4, seed=3), "b")  # churn of its own
        assert poll(lambda: synced(index, second), timeout=60), sub.stats()
        assert not set(index.counts(RID, MEDIUM_STORAGE)) & set(old_disk)
        assert sub.stats()[RID].restarts + sub.stats()[RID].snapshots >= 1
        second.close()
    finally:
        sub.close()
        pub.close()
