"""Test helpers: an engine-like source of block churn, a lossy forwarding proxy, views, and a
publisher with a subscriber joined to it."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import msgspec
import zmq

from kvroute.events import AllBlocksCleared, BlockRemoved, BlockSet, BlockStored, KVCacheEvent
from kvroute.events.framing import pack_seq
from kvroute.events.transport import ReplicaBatch, ZmqEventPublisher, ZmqEventSubscriber

from ...waiting import poll

BS = 4
LOCAL = "tcp://127.0.0.1:*"


class Churn:
    """Random stores (new chains, extensions, duplicate copies), removes and rare clears,
    with the true multiset of held hashes kept independently of any kvroute code."""

    def __init__(self, seed: int, clear_every: int = 0) -> None:
        self.rng = random.Random(seed)
        self.truth: Counter[bytes] = Counter()
        self.next_id = 0
        self.clear_every = clear_every
        self.steps = 0

    def _new_hash(self) -> bytes:
        self.next_id += 1
        return self.next_id.to_bytes(16, "big")

    def step(self, max_events: int = 6) -> list[KVCacheEvent]:
        self.steps += 1
        rng, events = self.rng, []
        if self.clear_every and self.steps % self.clear_every == 0:
            self.truth.clear()
            return [AllBlocksCleared()]
        for _ in range(rng.randint(1, max_events)):
            held = list(self.truth)
            r = rng.random()
            if r < 0.45 or not held:
                n = rng.randint(1, 4)
                parent = rng.choice(held) if held and rng.random() < 0.7 else None
                hs = [self._new_hash() for _ in range(n)]
                events.append(
                    BlockStored(
                        hs,
                        parent,
                        [rng.randrange(50_000) for _ in range(n * BS)],
                        BS,
                        None,
                        "GPU",
                        None,
                    )
                )
                self.truth.update(hs)
            elif r < 0.55:
                h = rng.choice(held)  # a second physical copy of a held hash
                events.append(BlockStored([h], None, [1] * BS, BS, None, "GPU", None))
                self.truth[h] += 1
            else:
                k = rng.randint(1, min(3, len(held)))
                hs = rng.sample(held, k)
                events.append(BlockRemoved(hs, "GPU"))
                for h in hs:
                    self.truth[h] -= 1
                    if not self.truth[h]:
                        del self.truth[h]
        return events


class Views:
    """What a consumer of the subscriber rebuilds, one BlockSet per replica."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sets: dict[str, BlockSet] = {}
        self.sources: Counter[str] = Counter()

    def __call__(self, item: ReplicaBatch) -> None:
        with self.lock:
            self.sets.setdefault(item.replica_id, BlockSet()).apply_batch(item.batch)
            self.sources[item.source] += 1

    def counts(self, rid: str) -> dict:
        with self.lock:
            s = self.sets.get(rid)
            return s.counts() if s else {}


class LossyProxy:
    """Forwards a PUB stream, dropping (or corrupting) messages as ``fate`` decides."""

    def __init__(self, upstream: str, fate: Callable[[list[bytes]], list[bytes] | None]) -> None:
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.fate = fate
        self.forwarded = self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            frames = self._sub.recv_multipart()
            out = self.fate(frames)
            if out is None:
                self.dropped += 1
            else:
                self.forwarded += 1
                self._pub.send_multipart(out)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(0)
        self._pub.close(0)


class VllmLikePublisher:
    """A publisher that frames exactly as vLLM does: int hashes, tagged-array events,
    replay replies of [b"", seq, payload] without a topic frame, and no snapshots."""

    def __init__(self, buffer_steps: int | None = None) -> None:
        ctx = zmq.Context.instance()
        self.buffer_steps = buffer_steps  # None: keep every batch (vLLM keeps 10,000)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        # While ``hold`` is set, a reply waits for ``release`` after its buffer was read, so
        # a test can publish while the reply is on its way.
        self.hold = threading.Event()
        self.buffer_read = threading.Event()
        self.release = threading.Event()
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def publish(self, events: list, send: bool = True) -> None:
        payload = msgspec.msgpack.encode([time.time(), events])
        with self.lock:
            self.buffer.append((self.seq, payload))
            if self.buffer_steps is not None:
                del self.buffer[: -self.buffer_steps]
            if send:
                self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
            self.seq += 1

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            ident, _, start_raw = self.router.recv_multipart()
            start = int.from_bytes(start_raw, "big")  # vLLM reads it unsigned
            with self.lock:
                reply = [(seq, payload) for seq, payload in self.buffer if seq >= start]
            if self.hold.is_set():
                self.buffer_read.set()
                self.release.wait(10)
            for seq, payload in reply:
                self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            # vLLM's end marker has no topic frame either: [b"", -1, b""]
            self.router.send_multipart([ident, b"", pack_seq(-1), b""])

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.pub.close(0)
        self.router.close(0)


def publisher(**kw) -> ZmqEventPublisher:
    kw.setdefault("heartbeat_interval", 0.05)
    return ZmqEventPublisher(LOCAL, LOCAL, **kw)


def wait_until_synced(sub, views, rid, truth, timeout=60.0) -> None:
    ok = poll(lambda: sub.in_sync(rid) and views.counts(rid) == dict(truth), timeout)
    assert ok, (
        f"view of {rid} never matched the engine: {len(views.counts(rid))} vs {len(truth)} "
        f"hashes; stats {sub.stats().get(rid)}"
    )


@contextlib.contextmanager
def joined(pub: ZmqEventPublisher) -> Iterator[tuple[ZmqEventSubscriber, Views]]:
    """A subscriber that has joined ``pub`` (as replica r0) and its views; both closed after."""
    views = Views()
    sub = ZmqEventSubscriber(views)
    try:
        sub.add_publisher("r0", pub.endpoint, pub.replay_endpoint, "r0")
        assert poll(lambda: sub.in_sync("r0")), "subscriber never joined"
        yield sub, views
    finally:
        sub.close()
        pub.close()


def assert_in_order(sub: ZmqEventSubscriber) -> None:
    """Every batch arrived live and in seq order: no gap seen, no replay asked for."""
    stats = sub.stats()["r0"]
    assert stats.gaps == 0 and stats.replays == 0, stats
