"""PrefixIndex live: matches while events apply on another thread, and a real ZeroMQ stream
from publishers to the index."""

from __future__ import annotations

import random
import threading
import time

from kvroute.events.transport import ZmqEventPublisher, ZmqEventSubscriber
from kvroute.router.routing.index import PrefixIndex

from ...waiting import poll
from .index_truth import Fleet, brute_match

LOCAL = "tcp://127.0.0.1:*"


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
