"""Replicas whose engine hashes kvroute cannot reproduce (vLLM's default ``sha256``) are
indexed by their events' token ids: real ZeroMQ publishers, the real Fleet and FrontDoor.

What it proves: a front door that runs a tenant's request (its salt, the router's hashes,
the salt it sends the engine as ``cache_salt``) routes a repeat of its prefix to the
engine that cached it under that salt; the index of a token-indexed replica equals the
index of kvroute-hashed events of the same cache, for a front door that joins late (by
replay from seq 0, as from vLLM, or by snapshot), across a restart and after a removal;
a replica whose block size differs is refused with a clear error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest

from kvroute.events import BlockHasher, BlockSet, EventBatch, regime_salt
from kvroute.events.replica_api import ReplicaInfo, SamplingParams
from kvroute.events.transport import ZmqEventPublisher
from kvroute.router.fleet.admission import Ticket
from kvroute.router.fleet.fleet import Fleet, FleetMismatchError
from kvroute.router.fleet.tenants import Tenants, tenants_from_api_keys
from kvroute.router.frontdoor import FrontDoor

from ...events.transport.streams import VllmLikePublisher
from ...events.twin import TwinCache, reachable, vllm_sha256_hashes
from ...waiting import poll, wait_for

BS = 16
SALTS = ["x" * 64, None]


def info(rid: str, pub: VllmLikePublisher | ZmqEventPublisher, **kw: object) -> ReplicaInfo:
    fields: dict = dict(
        replica_id=rid, model="tiny", model_path="/nonexistent", hash_algo="vllm:sha256",
        hash_seed="vllm-none-hash", hash_form="int", block_size=BS, num_blocks=64,
        max_model_len=4096, data_endpoint="", events_endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint, topic="", node_ip="127.0.0.1", pid=1,
        incarnation=f"{rid}-1", restarted=False,
    )  # fmt: skip
    fields.update(kw)
    return ReplicaInfo(**fields)


def publish(pub: VllmLikePublisher | ZmqEventPublisher, events: list) -> None:
    if isinstance(pub, ZmqEventPublisher):
        pub.publish(events)
    else:
        pub.publish([msgspec.to_builtins(e) for e in events])


def settle(subscriber, replica_id: str, pub: VllmLikePublisher) -> None:
    """Waits until the subscriber's SUB connection is live: a PUB socket drops what it sends
    before the subscription reaches it, so empty batches go out until one is read live."""
    before = subscriber.stats()[replica_id].received

    def heard() -> bool:
        publish(pub, [])
        return subscriber.stats()[replica_id].received > before

    wait_for(heard, 10, "the SUB connection live")


@pytest.fixture
def vllm_pub() -> Iterator[VllmLikePublisher]:
    pub = VllmLikePublisher()
    yield pub
    pub.close()


def test_a_tenants_repeated_prefix_goes_to_the_engine_that_cached_it(vllm_pub):
    """The whole request path: the front door hashes the tenant's prompt and names the salt
    it sends the engine; the engine (vLLM's ``sha256``) caches under that salt and says so
    in its events; the front door's index, fed their translation, sends the repeat there,
    and another tenant's identical prompt finds nothing."""
    idle = VllmLikePublisher()
    door = FrontDoor([(None, info("a", idle)), (None, info("b", vllm_pub))], tokenizer=object())
    try:
        assert door.fleet.hash_config.algo == "xxh3_128"  # no replica's hash is reproducible
        tenants = Tenants(tenants_from_api_keys({"ka": "alpha", "kb": "beta"}), "fleet-secret")
        alpha, beta = tenants.authenticate("Bearer ka"), tenants.authenticate("Bearer kb")
        prompt = list(range(1000, 1000 + 5 * BS + 7))
        sampling = SamplingParams(max_tokens=4)
        first = door.run(Ticket("alpha"), alpha, prompt, sampling, "conversation-1")
        # Replica b's engine runs it: vLLM's hashes of the salt it was sent, in its events.
        salt = first.request.cache_salt
        assert salt and salt.startswith(alpha.cache_salt)
        hashes = vllm_sha256_hashes(prompt, BS, salt)
        extra = [[salt]] + [None] * 4
        stored = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                  "token_ids": prompt[: 5 * BS], "block_size": BS, "lora_id": None,
                  "medium": "GPU", "lora_name": None, "extra_keys": extra}  # fmt: skip
        wait_for(lambda: door.fleet.subscriber.in_sync("b"), 10, "b's stream in sync")
        settle(door.fleet.subscriber, "b", vllm_pub)  # before the live batch
        vllm_pub.publish([stored])
        repeat = door.run(Ticket("alpha"), alpha, [*prompt, 5, 6], sampling, "conversation-1")
        wait_for(
            lambda: door.fleet.index.match(repeat.view.block_hashes) == {"b": 5},
            10,
            "b indexed as holding the prompt's 5 blocks",
        )
        assert door.route(repeat.view, ["a", "b"], time.monotonic()) == "b"
        other = door.run(Ticket("beta"), beta, prompt, sampling, "conversation-1")
        assert door.fleet.index.match(other.view.block_hashes) == {}
        unsalted = door.run(Ticket("alpha"), alpha, prompt, sampling)  # a salt of its own
        assert door.fleet.index.match(unsalted.view.block_hashes) == {}
    finally:
        door.fleet.subscriber.close()
        idle.close()


def churn(twin: TwinCache, steps: int, pub, kv: BlockSet) -> None:
    for _ in range(steps):
        kv_events, vllm_events = twin.step(SALTS)
        kv.apply_batch(EventBatch(0.0, kv_events))
        if vllm_events:
            publish(pub, vllm_events)


def test_a_late_front_door_rebuilds_by_replay_then_follows_restart_and_removal(vllm_pub):
    """As from vLLM (no snapshots): the front door joins after 200 steps and replays from
    seq 0; its index equals the kvroute-hashed view, live and after a restart."""
    fleet = Fleet([(None, info("r", vllm_pub))])
    twin = TwinCache(fleet.hasher, "bytes", seed=2)
    kv = BlockSet()
    fleet.subscriber.remove_publisher("r")  # not yet: join late
    try:
        churn(twin, 200, vllm_pub, kv)
        fleet.subscriber.add_publisher("r", vllm_pub.endpoint, vllm_pub.replay_endpoint)
        wait_for(lambda: fleet.index.counts("r") == kv.counts(), 10, "index rebuilt by replay")
        settle(fleet.subscriber, "r", vllm_pub)  # before live batches
        churn(twin, 200, vllm_pub, kv)
        wait_for(lambda: fleet.index.counts("r") == kv.counts(), 10, "index follows live")
        assert len(fleet.translators["r"]) == len(twin.held)
        # A restart: a new engine (empty cache, seq from 0) at new endpoints.
        fresh = VllmLikePublisher()
        try:
            fleet.add(None, info("r", fresh, incarnation="r-2"))
            wait_for(lambda: fleet.index.counts("r") == {}, 10, "old state dropped")
            twin2, kv2 = TwinCache(fleet.hasher, "bytes", seed=3), BlockSet()
            wait_for(lambda: fleet.subscriber.in_sync("r"), 10, "new stream in sync")
            # Not settle(): after a restart the probe batches were never counted within
            # 10 s (seen on main); the SUB connection's settling time, as before.
            time.sleep(0.2)
            churn(twin2, 100, fresh, kv2)
            wait_for(lambda: fleet.index.counts("r") == kv2.counts(), 10, "new engine indexed")
            # Removal: the index and the map forget it whole.
            fleet.fail("r")
            assert fleet.index.counts("r") == {} and len(fleet.translators["r"]) == 0
        finally:
            fresh.close()
    finally:
        fleet.subscriber.close()


def test_a_late_front_door_rebuilds_by_snapshot():
    """A publisher with snapshots (kvroute's) of a vLLM ``sha256`` stream: the snapshot's
    blocks come in any order, with their extra keys; the front door indexes every block a
    request can hit (those whose whole chain the engine holds)."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_interval=None)
    try:
        hasher = BlockHasher("xxh3_128", "vllm-none-hash", BS)
        twin, kv, engine = TwinCache(hasher, "bytes", seed=4), BlockSet(), BlockSet()
        for _ in range(300):
            kv_events, vllm_events = twin.step(SALTS)
            kv.apply_batch(EventBatch(0.0, kv_events))
            engine.apply_batch(EventBatch(0.0, vllm_events))
            if vllm_events:
                pub.publish(vllm_events)
        assert poll(lambda: pub.state.counts() == engine.counts(), 10)
        fleet = Fleet([(None, info("s", pub, hash_form="bytes"))])
        try:
            assert fleet.hasher.config == hasher.config
            want = reachable(engine, twin.kv_of)
            wait_for(lambda: fleet.index.counts("s") == want, 10, "index rebuilt by snapshot")
            assert fleet.subscriber.stats()["s"].snapshots == 1
        finally:
            fleet.subscriber.close()
    finally:
        pub.close()


def test_a_mixed_fleet_hashes_as_its_reproducible_replica(vllm_pub):
    """A sha256_cbor (reproducible) backend beside a sha256 one: the fleet hashes as the
    first, and the second's events are translated into it (vLLM's int form)."""
    other = VllmLikePublisher()
    good = info("good", other, hash_algo="sha256_cbor_tagged")
    fleet = Fleet([(None, info("tok", vllm_pub)), (None, good)])
    try:
        assert (fleet.hash_config.algo, fleet.hash_form) == ("sha256_cbor_tagged", "int")
        assert set(fleet.translators) == {"tok"}
        twin, kv = TwinCache(fleet.hasher, "int", seed=9), BlockSet()
        wait_for(lambda: fleet.subscriber.in_sync("tok"), 10, "in sync")
        settle(fleet.subscriber, "tok", vllm_pub)
        churn(twin, 150, vllm_pub, kv)
        wait_for(lambda: fleet.index.counts("tok") == kv.counts(), 10, "translated to int form")
    finally:
        fleet.subscriber.close()
        other.close()


def test_a_token_indexed_replica_with_other_blocks_is_refused(vllm_pub):
    fleet = Fleet([(None, info("a", vllm_pub))])
    try:
        with pytest.raises(FleetMismatchError, match="caches 32-token blocks, the fleet hashes 16"):
            fleet.add(None, info("b", vllm_pub, block_size=32))
        # Its seed and form are its engine's business: only the block size must agree.
        fleet.add(None, info("c", vllm_pub, hash_seed="any", hash_form="bytes"))
        assert set(fleet.translators) == {"a", "c"}
    finally:
        fleet.subscriber.close()


def test_prompts_past_a_rotary_switch_hash_as_the_replicas_salt_them(vllm_pub):
    """A fleet of longrope replicas (ReplicaInfo.long_prompt_after): a prompt past the
    switch is hashed with its regime's salt, as the engine caches it; one up to it as
    before; a replica with another switch is refused."""
    xxh3 = {"hash_algo": "xxh3_128", "hash_form": "bytes"}
    fleet = Fleet([(None, info("a", vllm_pub, **xxh3, long_prompt_after=40))])
    try:
        plain = BlockHasher(block_size=BS)
        long_prompt, short_prompt = list(range(3, 51)), list(range(3, 43))
        assert fleet.block_hashes(short_prompt, "t") == plain.hash_blocks(
            short_prompt, cache_salt="t"
        )
        assert fleet.block_hashes(long_prompt, "t") == plain.hash_blocks(
            long_prompt, cache_salt=regime_salt("t", len(long_prompt), 40)
        )
        assert (
            fleet.block_hashes(long_prompt, "t")[0]
            != plain.hash_blocks(long_prompt, cache_salt="t")[0]
        )
        with pytest.raises(FleetMismatchError, match="salts prompts past None tokens"):
            fleet.add(None, info("b", vllm_pub, **xxh3))
    finally:
        fleet.subscriber.close()
