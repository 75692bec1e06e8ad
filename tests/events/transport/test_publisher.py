"""The publisher's own behaviour: batches sent on the caller's thread in seq order, a queue
behind the thread while it sends, and overflow counted."""

from __future__ import annotations

import threading

from kvroute.events import EventBatch

from ...waiting import poll
from .streams import Churn, assert_in_order, joined, publisher, wait_until_synced


def test_inline_publishing_sends_every_batch_in_order():
    """The default: each batch is sent by the caller as it is published. 20,000 in a tight
    loop: none queued or dropped, none out of order (a subscriber would see a gap)."""
    pub = publisher(topic="r0")
    churn = Churn(seed=7)
    with joined(pub) as (sub, views):
        for _ in range(20_000):
            pub.publish(churn.step(max_events=2))
        assert pub.dropped == 0 and pub.sent >= 20_000
        wait_until_synced(sub, views, "r0", churn.truth)
        assert_in_order(sub)


def test_a_batch_published_while_the_thread_sends_waits_behind_it():
    """While the publisher's thread is marked as sending, a published batch queues (the
    caller must not use the socket then); the thread sends the queue, and batches published
    once it is empty again go out inline: all in seq order, none lost."""
    pub = publisher(topic="r0")
    churn = Churn(seed=8)
    with joined(pub) as (sub, views):
        senders: dict[int, str] = {}
        send = pub._send

        def spy(seq: int, batch: EventBatch) -> None:
            senders[seq] = threading.current_thread().name
            send(seq, batch)

        pub._send = spy  # type: ignore[method-assign]
        with pub._lock:
            pub._sending = True  # as the thread marks itself while it sends
        held = pub.publish(churn.step(max_events=2))
        with pub._lock:
            pub._sending = False
        pub._waker.wake()
        assert poll(lambda: held in senders)
        last = held
        for _ in range(500):
            last = pub.publish(churn.step(max_events=2))
        assert pub.flush(10) and pub.dropped == 0
        assert senders[held] == "kvr-publisher"  # queued, then sent by the thread
        assert senders[last] == threading.current_thread().name  # inline again
        wait_until_synced(sub, views, "r0", churn.truth)
        assert_in_order(sub)


def test_publish_never_blocks_and_counts_overflow():
    pub = publisher(topic="r0", max_queue_size=8, inline=False)
    churn = Churn(seed=6)
    with joined(pub) as (sub, views):
        for _ in range(20_000):
            pub.publish(churn.step(max_events=2))
        assert pub.dropped > 0  # the queue overflowed and said so...
        # ...and the subscriber still ends up with the engine's exact state (via snapshot).
        wait_until_synced(sub, views, "r0", churn.truth)
