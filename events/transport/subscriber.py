"""ZmqEventSubscriber: every replica's event stream, in order, with nothing silently lost.

Per replica the subscriber keeps ``last_seq``, the seq of the newest batch delivered, and a
small state machine:

- LIVE: a batch with ``seq == last_seq + 1`` is delivered. A higher seq is a gap: the
  batch is held back and the missing range is asked for on the replay socket. A lower seq
  means the engine restarted (its seq starts again at 0): everything known about the
  replica is dropped (a synthetic ``AllBlocksCleared`` is delivered) and the new stream is
  read from seq 0.
- SYNCING: a replay or snapshot request is outstanding; live batches wait in a bounded
  list. A replay that does not reach back to ``last_seq + 1`` (the engine's buffer no longer
  holds it) turns into a snapshot request. A snapshot is delivered as batches whose first
  event is ``AllBlocksCleared``, so applying deliveries in order always yields the engine's
  state. A publisher that cannot answer (vLLM without a replay socket, or one that is
  gone) costs only hits: the replica's state is dropped and rebuilt from what follows.
- A publisher that keeps no snapshots (vLLM: it reads the start seq as unsigned, so the
  snapshot request gets the end marker alone) is resynchronized from its replay buffer
  instead: state dropped, replay from seq 0. When the buffer no longer reaches back to 0
  (or to a gap), the view restarts at the buffer's first batch: blocks stored before it
  are missing (fewer hits), never ones the engine dropped.

A new publisher starts in SYNCING with a snapshot request, so a subscriber that joins late
still sees every block the engine already holds.

Malformed frames and payloads are counted, logged once per replica, and skipped; a
malformed payload is treated as a lost batch (its seq is recovered by replay or snapshot).
All sockets live on the subscriber's own thread, or, once :meth:`ZmqEventSubscriber.attach`
moved them, on an asyncio event loop; deliveries go to ``on_batch`` there and, if asked, to
an asyncio queue. A front door attaches its loop: every engine step sends it the step's
outputs on the data plane and the step's events here, and a second thread would be a second
wake-up (and a GIL hand-off) per step of every replica. The price: a snapshot is applied in
one piece on the loop (a pause that grows with the replica's cache, once per join or restart).

The sockets' wait is :mod:`.subscriber_loop`; the gap state machine above,
:mod:`.subscriber_recovery`; the replay socket's requests and replies,
:mod:`.subscriber_replay`; the per-replica types, :mod:`.subscription`. The thread waits on
the sockets' ``ZMQ_FD`` descriptors with the platform's selector (see
:mod:`.subscriber_loop`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import selectors
import threading
import time
from collections.abc import AsyncIterator, Callable

import zmq

from ..framing import SNAPSHOT_REQUEST, unpack_seq
from ..wire import EventBatch, MalformedBatchError, decode_batch
from .subscriber_loop import SubscriberLoop
from .subscriber_recovery import GapRecovery
from .subscriber_replay import ReplayClient
from .subscription import EVENTS, POLLIN, ReplicaBatch, ReplicaStats, Source, Subscription
from .threads import Waker

__all__ = ["ReplicaBatch", "ReplicaStats", "Source", "ZmqEventSubscriber"]

log = logging.getLogger(__name__)


class ZmqEventSubscriber(SubscriberLoop, GapRecovery, ReplayClient):
    def __init__(
        self,
        on_batch: Callable[[ReplicaBatch], None] | None = None,
        *,
        request_timeout: float = 2.0,
        max_attempts: int = 3,
        max_pending: int = 100_000,
        max_message_bytes: int = 64 << 20,
        rcvhwm: int = 100_000,
        context: zmq.Context | None = None,
    ) -> None:
        self._on_batch = on_batch
        self.request_timeout = request_timeout
        self.max_attempts = max_attempts
        self.max_pending = max_pending
        self.max_message_bytes = max_message_bytes
        self.rcvhwm = rcvhwm
        self.malformed_frames = 0  # messages whose framing named no seq
        self._ctx = context or zmq.Context.instance()
        self._replicas: dict[str, Subscription] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waker = Waker()
        self._async_sinks: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        # descriptor -> its handler, to run before the next wait (see the module docstring)
        self._again: dict[int, Callable[[], None]] = {}
        self._running = True
        self._loop: asyncio.AbstractEventLoop | None = None  # set by attach()
        self._detaching = False  # attach(): the thread stops, the loop takes over
        self._selector = selectors.DefaultSelector()
        self._watch(self._waker.fd, self._on_waker)
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="kvr-subscriber", daemon=True
        )
        self._thread.start()

    # -- public API (any thread) -------------------------------------------------------
    def add_publisher(
        self,
        replica_id: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
    ) -> None:
        """Follow one engine. ``replay_endpoint`` enables gap recovery and snapshots."""
        self._call(lambda: self._add(replica_id, endpoint, replay_endpoint, topic.encode()))

    def remove_publisher(self, replica_id: str) -> None:
        self._call(lambda: self._remove(replica_id))

    def stats(self) -> dict[str, ReplicaStats]:
        """Counters per replica, read from the caller's thread.

        Not routed through the subscriber's thread: a busy or stalled receive loop must not
        make monitoring wait, or answer with some replicas missing. Copying the replica
        table is one C-level call under the GIL; each counter is read whole, so a snapshot
        may straddle a batch but never holds torn or absent entries.
        """
        out: dict[str, ReplicaStats] = {}
        for rid, r in list(self._replicas.items()):
            fields = {k: getattr(r.stats, k) for k in r.stats.__slots__}
            fields["last_seq"] = r.last_seq
            out[rid] = ReplicaStats(**fields)
        return out

    def in_sync(self, replica_id: str) -> bool:
        """True when no recovery is outstanding for the replica (its view is current)."""
        r = self._replicas.get(replica_id)
        return r is not None and not r.syncing and not r.pending

    async def stream(self, maxsize: int = 0) -> AsyncIterator[ReplicaBatch]:
        """Deliveries as an async iterator on the caller's event loop."""
        q: asyncio.Queue[ReplicaBatch] = asyncio.Queue(maxsize)
        sink = (asyncio.get_running_loop(), q)
        self._call(lambda: self._async_sinks.append(sink))
        try:
            while True:
                yield await q.get()
        finally:
            self._call(lambda: self._async_sinks.remove(sink))

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Moves the subscriber from its thread onto ``loop``, where it stays: its thread
        calls ``on_batch`` from then on. Call from the loop's thread (a front door does, once
        its loop runs), and every later method too."""
        if self._loop is not None or not self._running:
            return
        assert self._thread is not None
        self._detaching = True
        self._waker.wake()
        self._thread.join()
        self._thread = None
        keys = [k for k in self._selector.get_map().values() if k.fd != self._waker.fd]
        self._selector.close()
        self._again.clear()  # every socket is looked at once below
        self._loop = loop
        for key in keys:
            loop.add_reader(key.fd, key.data)
            loop.call_soon(key.data)  # what arrived while it moved
        while True:
            try:
                loop.call_soon(self._command, self._commands.get_nowait())
            except queue.Empty:
                break
        if any(r.syncing for r in self._replicas.values()):
            loop.call_later(self._poll_timeout_s(), self._on_deadline)

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        if self._thread is not None:
            self._waker.wake()
            self._thread.join(5.0)
        for r in self._replicas.values():
            self._close_sockets(r)
        if self._thread is not None:
            self._selector.close()
        self._waker.close()

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[], None]) -> None:
        if not self._running:
            raise RuntimeError("subscriber is closed")
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._command, fn)
            return
        self._commands.put(fn)
        self._waker.wake()

    def _add(self, rid: str, endpoint: str, replay_endpoint: str | None, topic: bytes) -> None:
        if rid in self._replicas:
            raise ValueError(f"replica {rid!r} is already followed")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        r = Subscription(rid, endpoint, replay_endpoint, topic, sub)
        r.monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(endpoint)
        self._replicas[rid] = r
        self._watch(sub.getsockopt(zmq.FD), lambda: self._read_live(r))
        self._watch(r.monitor.getsockopt(zmq.FD), lambda: self._on_monitor(r))
        if replay_endpoint is not None:
            self._request(r, "snapshot", SNAPSHOT_REQUEST)

    def _remove(self, rid: str) -> None:
        r = self._replicas.pop(rid, None)
        if r is not None:
            self._close_sockets(r)

    def _close_sockets(self, r: Subscription) -> None:
        if r.monitor is not None:
            try:
                r.sub.disable_monitor()
            except zmq.ZMQError:
                pass
        for s in (r.monitor, r.sub, r.dealer):
            if s is None:
                continue
            if not s.closed:
                self._unwatch(s)
            s.close(linger=0)
        r.dealer = r.monitor = None

    # -- live stream -------------------------------------------------------------------
    def _read_live(self, r: Subscription, budget: int = 1024) -> None:
        if r.monitor is not None:  # a reconnect must be seen before what came after it
            self._on_monitor(r)
        sub = r.sub
        for _ in range(budget):
            # Asked, not tried: a zmq.Again per drained socket costs more than the question.
            if sub.closed or not sub.getsockopt(EVENTS) & POLLIN:
                return
            frames = sub.recv_multipart(zmq.NOBLOCK)
            r.stats.received += 1
            r.stats.last_heard = time.monotonic()
            if len(frames) != 3:
                self._malformed(r, f"{len(frames)} frames")
                self.malformed_frames += 1
                continue
            try:
                seq = unpack_seq(frames[1])
            except ValueError as e:
                self._malformed(r, str(e))
                self.malformed_frames += 1
                continue
            batch = self._decode(r, frames[2])
            self._on_live(r, seq, batch)
        if not sub.closed:  # the budget ran out: the rest waits one turn, not for a signal
            self._look_again(sub, lambda: self._read_live(r))

    def _decode(self, r: Subscription, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except MalformedBatchError as e:
            self._malformed(r, str(e))
            return None

    def _malformed(self, r: Subscription, why: str) -> None:
        r.stats.malformed += 1
        if not r.warned_malformed:
            r.warned_malformed = True
            log.warning(
                "replica %s: malformed event message skipped (%s); further ones are only counted",
                r.replica_id,
                why,
            )

    def _on_live(self, r: Subscription, seq: int, batch: EventBatch | None) -> None:
        # One connection delivers in order, so the live seq only goes back on a restart.
        # (Comparing with last_seq instead would mistake batches that were still queued
        # in the socket when a snapshot overtook them for a restart.)
        if r.live_seq is not None and seq <= r.live_seq:
            self._restart(r)
        r.live_seq = seq
        if r.syncing:
            if len(r.pending) >= self.max_pending:
                r.pending.pop(0)  # the gap this opens is recovered after the sync
            r.pending.append((seq, batch))
            return
        if seq <= r.last_seq:
            return  # already covered by a snapshot or replay
        if seq == r.last_seq + 1 and batch is not None:
            self._deliver(r, seq, batch, "live")
            return
        # A gap (or a malformed batch, which is as good as lost).
        r.stats.gaps += 1
        r.pending.append((seq, batch))
        self._recover(r)

    # -- delivery ----------------------------------------------------------------------
    def _deliver(self, r: Subscription, seq: int, batch: EventBatch, source: Source) -> None:
        r.last_seq = seq
        r.stats.delivered += 1
        self._emit(r, ReplicaBatch(r.replica_id, seq, batch, source))

    def _emit(self, r: Subscription, item: ReplicaBatch) -> None:
        if self._on_batch is not None:
            try:
                self._on_batch(item)
            except Exception:
                log.exception("on_batch callback failed for replica %s", r.replica_id)
        for loop, q in self._async_sinks:
            loop.call_soon_threadsafe(q.put_nowait, item)
