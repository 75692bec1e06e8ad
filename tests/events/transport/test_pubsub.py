"""Publisher and subscriber over real loopback sockets: nothing is silently lost (lossy
paths, gaps, snapshots, restarts, heartbeats, garbage on the wire). vLLM-style streams and
the replay socket's protocol have files of their own (test_pubsub_vllm_streams.py,
test_replay_protocol.py)."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import pytest
import zmq

from kvroute.events import BlockStored, EventBatch, encode_batch
from kvroute.events.framing import pack_seq
from kvroute.events.transport import ZmqEventPublisher, ZmqEventSubscriber

from ...waiting import poll
from .streams import BS, LOCAL, Churn, LossyProxy, Views, publisher, wait_until_synced

pytestmark = pytest.mark.usefixtures("where")  # conftest.py: every test on a thread and on a loop


def test_100k_events_through_a_lossy_path_rebuild_the_exact_block_set():
    churn = Churn(seed=1)
    pub = publisher(topic="r0", buffer_steps=200)
    rng = random.Random(7)
    proxy = LossyProxy(pub.endpoint, lambda f: None if rng.random() < 0.05 else f)
    views = Views()
    sub = ZmqEventSubscriber(views)
    try:
        sub.add_publisher("r0", proxy.endpoint, pub.replay_endpoint, "r0")
        n_events = 0
        while n_events < 100_000:
            events = churn.step()
            n_events += len(events)
            pub.publish(events)
            # An engine publishes once per step, then computes (releasing the GIL); a
            # producer that never lets go of it would starve every thread of this process.
            time.sleep(0.0001)
        wait_until_synced(sub, views, "r0", churn.truth)
        stats = sub.stats()["r0"]
        assert proxy.dropped > 500  # the path really lost messages...
        assert stats.gaps > 50 and stats.replays > 50  # ...which were noticed and replayed
        assert stats.malformed == 0 and stats.restarts == 0
        assert pub.state.counts() == dict(churn.truth)  # the publisher's own ledger agrees
    finally:
        sub.close()
        proxy.close()
        pub.close()


def test_gap_older_than_replay_buffer_falls_back_to_snapshot():
    churn = Churn(seed=2)
    pub = publisher(topic="r0", buffer_steps=4)
    state = {"drop": False}
    proxy = LossyProxy(pub.endpoint, lambda f: None if state["drop"] else f)
    views = Views()
    sub = ZmqEventSubscriber(views)
    try:
        sub.add_publisher("r0", proxy.endpoint, pub.replay_endpoint, "r0")
        for _ in range(50):
            pub.publish(churn.step())
        wait_until_synced(sub, views, "r0", churn.truth)
        state["drop"] = True  # a burst of 40 lost batches: far more than the 4 buffered
        for _ in range(40):
            pub.publish(churn.step())
        pub.flush()
        assert poll(lambda: proxy.dropped >= 40, timeout=10), "the burst was not all dropped"
        state["drop"] = False
        for _ in range(20):
            pub.publish(churn.step())
        wait_until_synced(sub, views, "r0", churn.truth)
        stats = sub.stats()["r0"]
        assert stats.snapshots >= 2  # the join, and the fallback
        assert views.sources["snapshot"] >= 2
    finally:
        sub.close()
        proxy.close()
        pub.close()


def test_late_joiner_gets_a_snapshot():
    churn = Churn(seed=3)
    pub = publisher(topic="r0", buffer_steps=10)
    views = Views()
    sub = ZmqEventSubscriber(views)
    try:
        for _ in range(1000):
            pub.publish(churn.step())
        pub.flush()
        sub.add_publisher("r0", pub.endpoint, pub.replay_endpoint, "r0")
        wait_until_synced(sub, views, "r0", churn.truth)
        for _ in range(100):  # and it keeps following live after the snapshot
            pub.publish(churn.step())
        wait_until_synced(sub, views, "r0", churn.truth)
        assert len(churn.truth) > 100
        assert views.sources["snapshot"] >= 1 and views.sources["live"] >= 50
    finally:
        sub.close()
        pub.close()


def test_duplicate_copies_are_counted_per_hash():
    pub = publisher(topic="r0")
    views = Views()
    sub = ZmqEventSubscriber(views)
    h = b"\x07" * 16
    try:
        sub.add_publisher("r0", pub.endpoint, pub.replay_endpoint, "r0")
        assert poll(lambda: sub.in_sync("r0")), "subscriber never joined"
        from kvroute.events import BlockRemoved

        pub.publish([BlockStored([h], None, [1] * BS, BS, None, "GPU", None)])
        pub.publish([BlockStored([h], None, [1] * BS, BS, None, "GPU", None)])
        pub.publish([BlockRemoved([h], "GPU")])
        assert poll(lambda: views.counts("r0") == {h: 1})
        pub.publish([BlockRemoved([h], "GPU")])
        assert poll(lambda: views.counts("r0") == {})
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("new_batches", [5, 400])
def test_publisher_restart_mid_stream_drops_the_old_state(new_batches):
    old = Churn(seed=4)
    pub = publisher(topic="r0")
    port = pub.endpoint.rsplit(":", 1)[1]
    rport = pub.replay_endpoint.rsplit(":", 1)[1]
    views = Views()
    sub = ZmqEventSubscriber(views)
    try:
        sub.add_publisher("r0", pub.endpoint, pub.replay_endpoint, "r0")
        for _ in range(200):
            pub.publish(old.step())
        wait_until_synced(sub, views, "r0", old.truth)
        pub.close()
        # Same addresses, a new engine with an empty cache and seq starting again at 0.
        new = Churn(seed=5)
        new.next_id = 10**9  # hashes the old engine never had
        pub = ZmqEventPublisher(
            f"tcp://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{rport}",
            topic="r0",
            heartbeat_interval=0.05,
        )
        for _ in range(new_batches):
            pub.publish(new.step())
        wait_until_synced(sub, views, "r0", new.truth)
        assert not set(views.counts("r0")) & set(old.truth)
    finally:
        sub.close()
        pub.close()


def test_many_publishers_each_with_their_own_view():
    pubs = [publisher(topic=f"r{i}") for i in range(4)]
    churns = [Churn(seed=10 + i) for i in range(4)]
    views = Views()
    sub = ZmqEventSubscriber(views)
    try:
        for i, p in enumerate(pubs):
            sub.add_publisher(f"r{i}", p.endpoint, p.replay_endpoint, f"r{i}")
        for _ in range(300):
            for p, c in zip(pubs, churns, strict=True):
                p.publish(c.step())
        for i, c in enumerate(churns):
            wait_until_synced(sub, views, f"r{i}", c.truth)
        # each view is its own publisher's, none mixed with another's
        views_by_rid = [views.counts(f"r{i}") for i in range(4)]
        assert all(v == dict(c.truth) for v, c in zip(views_by_rid, churns, strict=True))
        assert len({frozenset(v) for v in views_by_rid}) == 4
    finally:
        sub.close()
        for p in pubs:
            p.close()


def test_idle_publisher_sends_heartbeats_so_a_lost_last_batch_is_noticed():
    pub = publisher(topic="r0", heartbeat_interval=0.05)
    dropped = {"n": 0}

    def drop_first_real_batch(frames):
        if msgspec.msgpack.decode(frames[2])[1] and not dropped["n"]:
            dropped["n"] = 1
            return None
        return frames

    proxy = LossyProxy(pub.endpoint, drop_first_real_batch)
    views = Views()
    sub = ZmqEventSubscriber(views)
    try:
        sub.add_publisher("r0", proxy.endpoint, pub.replay_endpoint, "r0")
        assert poll(lambda: sub.in_sync("r0") and sub.stats()["r0"].received > 0)
        h = b"\x09" * 16
        pub.publish([BlockStored([h], None, [0] * BS, BS, None, "GPU", None)])
        # Nothing else is published: only the heartbeat reveals that a batch went missing.
        assert poll(lambda: views.counts("r0") == {h: 1}, timeout=10)
        assert dropped["n"] == 1 and sub.stats()["r0"].gaps >= 1
    finally:
        sub.close()
        proxy.close()
        pub.close()


def test_async_stream_delivers_in_order():

    pub = publisher(topic="r0", heartbeat_interval=None)
    sub = ZmqEventSubscriber()

    async def main():
        it = sub.stream()
        first = asyncio.ensure_future(it.__anext__())
        # One turn of the loop runs the stream up to its first wait: its sink is queued to
        # the subscriber's thread ahead of the publisher added next (commands run in order).
        await asyncio.sleep(0)
        sub.add_publisher("r0", pub.endpoint, pub.replay_endpoint, "r0")
        got = [await asyncio.wait_for(first, 10)]
        for i in range(20):
            pub.publish([BlockStored([bytes([i + 1]) * 16], None, [0] * BS, BS, None, "GPU", None)])
        while not got or got[-1].seq < 19:
            got.append(await asyncio.wait_for(it.__anext__(), 10))
        await it.aclose()
        return got

    try:
        got = asyncio.run(main())
        assert got[0].source == "snapshot"
        live = [g.seq for g in got if g.source != "snapshot"]
        assert live == sorted(live) and live[-1] == 19
    finally:
        sub.close()
        pub.close()


# -- garbage on the wire ------------------------------------------------------------------
def test_garbage_is_counted_and_skipped_and_the_stream_goes_on():
    ctx = zmq.Context.instance()
    raw_pub = ctx.socket(zmq.PUB)
    raw_pub.bind(LOCAL)
    endpoint = raw_pub.getsockopt_string(zmq.LAST_ENDPOINT)
    views = Views()
    sub = ZmqEventSubscriber(views)
    try:
        sub.add_publisher("r0", endpoint)  # no replay socket: garbage cannot be recovered
        # wait until the SUB connection is up: keep sending seq 0 until it is seen
        h0 = b"\x01" * 16
        ok = EventBatch(0.0, [BlockStored([h0], None, [0] * BS, BS, None, "GPU", None)])
        assert poll(
            lambda: (
                raw_pub.send_multipart([b"", pack_seq(0), encode_batch(ok)])
                or views.counts("r0") == {h0: 1}
            ),
            timeout=10,
        )
        malformed_before = sub.stats()["r0"].malformed
        garbage = [
            [b"only one frame"],
            [b"", b"short", b"x"],
            [b"", pack_seq(1), b"\xc1\xc1"],  # not msgpack
            [b"", pack_seq(2), encode_batch(ok)[:-4]],  # truncated
            [b"", pack_seq(3), msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])],
            [b"", pack_seq(4), msgspec.msgpack.encode({"ts": "x", "events": 5})],
            [b"", pack_seq(5), b"\xdd\x7f\xff\xff\xff" + b"\x00" * 64],  # claims a huge list
            [
                b"",
                pack_seq(6),
                msgspec.msgpack.encode(
                    [
                        1.0,
                        [
                            {
                                "type": "BlockRemoved",
                                "block_hashes": list(range(200_000)),
                                "medium": 3,
                            }
                        ],
                    ]
                ),
            ],
            [b"", pack_seq(7), b"", b"", b""],
        ]
        for frames in garbage:
            raw_pub.send_multipart(frames)
        h8 = b"\x08" * 16
        good = EventBatch(0.0, [BlockStored([h8], None, [0] * BS, BS, None, "GPU", None)])
        raw_pub.send_multipart([b"", pack_seq(8), encode_batch(good)])
        assert poll(lambda: h8 in views.counts("r0"), timeout=10)
        stats = sub.stats()["r0"]
        assert stats.malformed - malformed_before == len(garbage)
        assert stats.resets >= 1  # the unrecoverable hole dropped the old state
    finally:
        sub.close()
        raw_pub.close(0)
