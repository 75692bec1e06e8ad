"""KV events end to end: a real engine -> ZmqEventPublisher -> ZmqEventSubscriber -> BlockSet.

Why end to end: the router only ever sees what crosses the wire, so the property that matters
is that a subscriber's rebuilt view equals the engine's true cache after prefix sharing,
duplicate copies, evictions, preemption and a cache reset, in both hash forms (kvroute's
bytes and vLLM's int).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from kvroute.events import AllBlocksCleared, BlockRemoved, BlockSet, BlockStored, KVCacheEvent
from kvroute.events.transport import ReplicaBatch, ZmqEventPublisher, ZmqEventSubscriber
from kvroute.replica import EngineConfig, LLMEngine, SamplingParams

from ...waiting import poll

LOCAL = "tcp://127.0.0.1:*"
BLOCK = 4
NUM_BLOCKS = 16  # 64 token slots: the workload below needs several times that
RID = "replica-0"


class View:
    """The subscriber side: one BlockSet fed from the subscriber's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocks = BlockSet()

    def __call__(self, item: ReplicaBatch) -> None:
        assert item.replica_id == RID
        with self.lock:
            self.blocks.apply_batch(item.batch)

    def counts(self) -> dict:
        with self.lock:
            return self.blocks.counts()


class Tally:
    """Counts what the engine handed to its sinks, to prove the workload did churn."""

    def __init__(self) -> None:
        self.kinds: Counter[str] = Counter()

    def __call__(self, events: list[KVCacheEvent]) -> None:
        for ev in events:
            self.kinds[type(ev).__name__] += 1


# The cost-model replica (sim:) runs the same scheduler and cache: its events must be as true.
@pytest.fixture(params=[("tiny", "bytes"), ("tiny", "int"), ("sim:h100-8b", "bytes")])
def wired(request) -> Iterator[tuple[LLMEngine, ZmqEventSubscriber, View, Tally]]:
    model, form = request.param
    pub = ZmqEventPublisher(LOCAL, LOCAL, topic=RID, heartbeat_interval=0.05)
    view = View()
    sub = ZmqEventSubscriber(view)
    tally = Tally()
    engine = LLMEngine(
        EngineConfig(
            model=model,
            block_size=BLOCK,
            num_blocks=NUM_BLOCKS,
            max_num_batched_tokens=24,
            hash_form=form,
            time_scale=0.01,
        ),
        event_sinks=[pub.publish, tally],
    )
    try:
        sub.add_publisher(RID, pub.endpoint, pub.replay_endpoint, RID)
        assert poll(lambda: sub.in_sync(RID)), "subscriber never joined"
        yield engine, sub, view, tally
    finally:
        sub.close()
        pub.close()


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 4) -> list[int]:
    """Runs prompts to completion, all queued at once; returns their num_cached_tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    base = engine.num_steps
    for i, p in enumerate(prompts):
        engine.add_request(f"{base}-{i}", p, params)
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    return [cached[f"{base}-{i}"] for i in range(len(prompts))]


def truth(engine: LLMEngine) -> dict:
    return engine.kv_cache_manager.block_pool.cached_hash_counts()


def assert_converges(engine: LLMEngine, sub: ZmqEventSubscriber, view: View) -> None:
    want = truth(engine)
    ok = poll(lambda: sub.in_sync(RID) and view.counts() == want)
    got = view.counts()
    assert ok, (
        f"subscriber view never matched the engine: {len(got)} vs {len(want)} hashes, "
        f"missing {len(set(want) - set(got))}, extra {len(set(got) - set(want))}; "
        f"stats {sub.stats().get(RID)}"
    )


SHARED = list(range(40, 52))  # 3 full blocks every "family" request starts with


def family(k: int, length: int = 7) -> list[int]:
    return SHARED + [100 + k] * length


def test_subscriber_view_equals_engine_cache(
    wired: tuple[LLMEngine, ZmqEventSubscriber, View, Tally],
) -> None:
    engine, sub, view, tally = wired
    form = engine.config.hash_form

    # 1. Prefix sharing: the first request stores the shared blocks, later ones hit them.
    cached = run(engine, [family(0)])
    cached += run(engine, [family(1), family(2)])
    assert cached[0] == 0 and min(cached[1:]) >= len(SHARED)
    assert_converges(engine, sub, view)
    assert all(isinstance(h, bytes if form == "bytes" else int) for h in view.counts())

    # 2. Two copies of one hash: the same unaligned prompt twice in one step hits the full
    #    blocks but decodes its tail block twice, storing that block's hash in two copies.
    twin = [*range(60, 70)]  # 2 full blocks and 2 tokens: the tail block fills by decoding
    run(engine, [twin, twin], max_tokens=3)
    assert any(n == 2 for n in truth(engine).values()), "no duplicate copy was made"
    assert_converges(engine, sub, view)

    # 3. Eviction and preemption: far more distinct blocks than the pool holds, at once.
    stored_before = tally.kinds["BlockStored"]
    run(engine, [[200 + k] * 22 for k in range(5)], max_tokens=5)
    assert tally.kinds["BlockRemoved"] > 0, "nothing was evicted"
    assert engine.scheduler.num_preemptions > 0, "nothing was preempted"
    assert tally.kinds["BlockStored"] > stored_before
    assert_converges(engine, sub, view)
    assert len(view.counts()) > 0

    # 4. A cache reset clears the subscriber's view too; new work is seen after it.
    assert engine.reset_prefix_cache()
    assert tally.kinds["AllBlocksCleared"] == 1
    assert truth(engine) == {}
    assert_converges(engine, sub, view)
    assert view.counts() == {}
    assert run(engine, [family(3)]) == [0]  # nothing left to hit
    run(engine, [family(4)])
    assert_converges(engine, sub, view)
    assert len(view.counts()) >= len(SHARED) // BLOCK

    stats = sub.stats()[RID]
    assert stats.malformed == 0 and stats.restarts == 0


def test_engine_events_carry_chain_and_tokens(
    wired: tuple[LLMEngine, ZmqEventSubscriber, View, Tally],
) -> None:
    """Stores name their parent and tokens, so a router can rebuild prefix trees from them."""
    engine, _, _, _ = wired
    seen: list[KVCacheEvent] = []
    engine.event_sinks.append(seen.extend)
    run(engine, [family(0)])
    run(engine, [family(0) + [9] * 5])  # extends the first request's chain
    stores = [ev for ev in seen if isinstance(ev, BlockStored)]
    assert not any(isinstance(ev, (BlockRemoved, AllBlocksCleared)) for ev in seen)
    first, second = stores[0], stores[-1]
    assert first.parent_block_hash is None
    assert first.token_ids[: len(SHARED)] == SHARED
    assert all(len(ev.token_ids) == BLOCK * len(ev.block_hashes) for ev in stores)
    # "GPU": the engine's primary cache on any hardware, as vLLM names it ("CPU" is a host
    # tier beneath it, whose copies routers price as loads)
    assert all(ev.block_size == BLOCK and ev.medium == "GPU" for ev in stores)
    # The second request's new blocks hang under a block the first one stored.
    known = {h for ev in stores[:-1] for h in ev.block_hashes}
    assert second.parent_block_hash in known
