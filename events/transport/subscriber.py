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

The thread waits on the sockets' ``ZMQ_FD`` descriptors with the platform's selector
(epoll, kqueue), not ``zmq.Poller`` (two system calls and a scan of every socket per
wake-up). A ``ZMQ_FD`` signals edge-like (readable when the socket's state changed, not
while messages wait), so a socket reported ready is drained until ``ZMQ_EVENTS`` says it is
empty, and one whose reading was cut short (a budget) or whose signal a send may have
consumed is looked at again before the next wait.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import selectors
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..framing import SNAPSHOT_REQUEST, pack_seq, unpack_seq
from ..wire import AllBlocksCleared, EventBatch, MalformedBatchError, decode_batch
from .threads import Waker, name_native_thread

log = logging.getLogger(__name__)

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: no IntFlag per question

Source = Literal["live", "replay", "snapshot", "reset"]


@dataclass(slots=True)
class ReplicaBatch:
    """One delivery: apply ``batch`` to ``replica_id``'s state, in delivery order."""

    replica_id: str
    seq: int
    batch: EventBatch
    source: Source


@dataclass(slots=True)
class ReplicaStats:
    received: int = 0  # live messages read
    delivered: int = 0  # batches handed to the consumer (all sources)
    gaps: int = 0
    replays: int = 0  # replay requests sent
    snapshots: int = 0  # snapshot requests sent
    restarts: int = 0
    resets: int = 0  # times the replica's state was dropped (restart or unrecoverable gap)
    malformed: int = 0
    request_timeouts: int = 0
    last_seq: int = -1
    last_heard: float = 0.0  # time.monotonic() of the newest live message


@dataclass
class _Subscription:
    """One publisher this subscriber follows: its sockets and where its stream stands."""

    replica_id: str
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    sub: zmq.Socket
    dealer: zmq.Socket | None = None
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    last_seq: int = -1
    syncing: Literal["", "replay", "snapshot"] = ""
    deadline: float = 0.0
    attempts: int = 0
    pending: list[tuple[int, EventBatch | None]] = field(default_factory=list)
    reply: list[tuple[int, bytes]] = field(default_factory=list)
    snapshot_supported: bool = True
    warned_malformed: bool = False
    live_seq: int | None = None  # newest seq read on the live socket
    monitor: zmq.Socket | None = None
    was_disconnected: bool = False


class ZmqEventSubscriber:
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
        self._replicas: dict[str, _Subscription] = {}
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

    # -- the subscriber's thread (or loop) -----------------------------------------------
    def _run(self) -> None:
        name_native_thread()
        while self._running and not self._detaching:
            again, self._again = self._again, {}
            timeout = 0.0 if again else self._poll_timeout_s()
            try:
                ready = self._selector.select(timeout)
            except (OSError, ValueError):  # a descriptor closed under it
                if not self._running:
                    break
                raise
            for key, _ in ready:
                again[key.fileobj] = key.data  # type: ignore[index]
            for handler in again.values():
                handler()
            self._check_deadlines()

    def _watch(self, fd: int, handler: Callable[[], None]) -> None:
        if self._loop is not None:
            self._loop.add_reader(fd, handler)
        else:
            self._selector.register(fd, selectors.EVENT_READ, handler)

    def _unwatch(self, sock: zmq.Socket) -> None:
        fd = sock.getsockopt(zmq.FD)
        if self._loop is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(fd)
            return
        try:
            self._selector.unregister(fd)
        except KeyError:
            pass
        self._again.pop(fd, None)

    def _look_again(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        """Run ``handler`` before the next wait: ``sock`` may hold messages its FD will
        not signal again."""
        if self._loop is not None:
            self._loop.call_soon(handler)
        else:
            self._again[sock.getsockopt(zmq.FD)] = handler

    def _on_waker(self) -> None:
        self._waker.drain()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            self._command(cmd)

    def _command(self, cmd: Callable[[], None]) -> None:
        if not self._running:
            return
        try:
            cmd()
        except Exception:
            log.exception("subscriber command failed")

    def _poll_timeout_s(self) -> float:
        deadlines = [r.deadline for r in self._replicas.values() if r.syncing]
        if not deadlines:
            return 1.0
        return max(0.0, min(deadlines) - time.monotonic() + 0.001)

    def _add(self, rid: str, endpoint: str, replay_endpoint: str | None, topic: bytes) -> None:
        if rid in self._replicas:
            raise ValueError(f"replica {rid!r} is already followed")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        r = _Subscription(rid, endpoint, replay_endpoint, topic, sub)
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

    def _close_sockets(self, r: _Subscription) -> None:
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

    def _cancel_request(self, r: _Subscription) -> None:
        """Forget an outstanding request; a fresh socket makes sure a late reply is never
        mistaken for the answer to a later request."""
        if r.dealer is not None:
            self._unwatch(r.dealer)
            r.dealer.close(linger=0)
            r.dealer = None
        r.syncing, r.reply = "", []

    # -- live stream -------------------------------------------------------------------
    def _read_live(self, r: _Subscription, budget: int = 1024) -> None:
        if r.monitor is not None:  # a reconnect must be seen before what came after it
            self._on_monitor(r)
        sub = r.sub
        for _ in range(budget):
            # Asked, not tried: a zmq.Again per drained socket costs more than the question.
            if sub.closed or not sub.getsockopt(_EVENTS) & _POLLIN:
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

    def _decode(self, r: _Subscription, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except MalformedBatchError as e:
            self._malformed(r, str(e))
            return None

    def _malformed(self, r: _Subscription, why: str) -> None:
        r.stats.malformed += 1
        if not r.warned_malformed:
            r.warned_malformed = True
            log.warning(
                "replica %s: malformed event message skipped (%s); further ones are only counted",
                r.replica_id,
                why,
            )

    def _on_live(self, r: _Subscription, seq: int, batch: EventBatch | None) -> None:
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

    def _restart(self, r: _Subscription) -> None:
        r.stats.restarts += 1
        log.info("replica %s restarted (seq went back from %s)", r.replica_id, r.live_seq)
        self._cancel_request(r)
        r.pending = []
        self._reset(r)

    def _on_monitor(self, r: _Subscription) -> None:
        """A reconnect may hide a restart: resynchronize from a snapshot to be sure."""
        while r.monitor is not None and r.monitor.getsockopt(_EVENTS) & _POLLIN:
            msg = recv_monitor_message(r.monitor, zmq.NOBLOCK)
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                r.was_disconnected = True
            elif msg["event"] == zmq.EVENT_CONNECTED and r.was_disconnected:
                r.was_disconnected = False
                r.live_seq = None
                if r.replay_endpoint is not None:
                    self._cancel_request(r)
                    r.pending = []
                    if r.snapshot_supported:
                        self._request(r, "snapshot", SNAPSHOT_REQUEST)
                    else:
                        self._resync(r)

    def _resync(self, r: _Subscription) -> None:
        """Rebuild a publisher without snapshots (vLLM) from its replay buffer: forget
        what is known and replay from seq 0 (the buffer's first batch if it rolled)."""
        if r.last_seq >= 0 or r.stats.delivered:
            self._reset(r)
        r.last_seq = -1
        self._request(r, "replay", 0)

    def _reset(self, r: _Subscription) -> None:
        r.stats.resets += 1
        r.last_seq = -1
        cleared = EventBatch(time.time(), [AllBlocksCleared()])
        self._emit(r, ReplicaBatch(r.replica_id, -1, cleared, "reset"))

    def _recover(self, r: _Subscription) -> None:
        """Fill the gap before ``r.pending``: replay if possible, else give up the state."""
        if r.replay_endpoint is None:
            self._give_up(r)
        else:
            self._request(r, "replay", r.last_seq + 1)

    def _give_up(self, r: _Subscription) -> None:
        """No way to fill the gap: drop what we knew and follow the stream from here on.

        The view then lacks blocks stored before the hole -- that costs hits, never
        correctness: blocks we do show are ones the engine announced after the reset."""
        self._cancel_request(r)
        r.attempts = 0
        if r.last_seq >= 0 or r.stats.delivered:
            self._reset(r)
        r.pending = [(seq, b) for seq, b in r.pending if b is not None]
        if r.pending:
            r.last_seq = r.pending[0][0] - 1
        self._drain_pending(r)

    def _drain_pending(self, r: _Subscription) -> None:
        pending, r.pending = r.pending, []
        for i, (seq, batch) in enumerate(pending):
            if seq <= r.last_seq:
                continue
            if seq == r.last_seq + 1 and batch is not None:
                self._deliver(r, seq, batch, "live")
                continue
            r.stats.gaps += 1
            r.pending = pending[i:]
            self._recover(r)
            return

    # -- replay and snapshot -----------------------------------------------------------
    def _request(self, r: _Subscription, kind: Literal["replay", "snapshot"], start: int) -> None:
        if r.dealer is None:
            r.dealer = self._ctx.socket(zmq.DEALER)
            r.dealer.setsockopt(zmq.LINGER, 0)
            r.dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            r.dealer.connect(r.replay_endpoint)
            self._watch(r.dealer.getsockopt(zmq.FD), lambda: self._read_reply(r))
        if kind == "replay":
            r.stats.replays += 1
        else:
            r.stats.snapshots += 1
        r.syncing = kind
        r.reply = []
        r.deadline = time.monotonic() + self.request_timeout
        r.dealer.send_multipart((b"", pack_seq(start)))
        self._look_again(r.dealer, lambda: self._read_reply(r))  # the send may take the edge
        if self._loop is not None:  # the thread looks after every wake-up
            self._loop.call_later(self.request_timeout + 0.001, self._on_deadline)

    def _on_deadline(self) -> None:
        if self._running:
            self._check_deadlines()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for r in list(self._replicas.values()):
            if r.syncing and now >= r.deadline:
                r.stats.request_timeouts += 1
                kind = r.syncing
                self._cancel_request(r)
                r.attempts += 1
                if r.attempts >= self.max_attempts:
                    log.warning(
                        "replica %s: no answer on %s, dropping its state",
                        r.replica_id,
                        r.replay_endpoint,
                    )
                    self._give_up(r)
                else:
                    start = SNAPSHOT_REQUEST if kind == "snapshot" else r.last_seq + 1
                    self._request(r, kind, start)

    def _read_reply(self, r: _Subscription) -> None:
        while r.dealer is not None:
            try:
                frames = r.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [b"", topic, seq, payload] (kvroute) or [b"", seq, payload] (vLLM)
            if len(frames) == 4:
                seq_raw, payload = frames[2], frames[3]
            elif len(frames) == 3:
                seq_raw, payload = frames[1], frames[2]
            else:
                self._malformed(r, f"replay reply of {len(frames)} frames")
                continue
            try:
                seq = unpack_seq(seq_raw)
            except ValueError as e:
                self._malformed(r, str(e))
                continue
            if payload == b"":  # end marker
                self._finish_reply(r)
                return
            r.reply.append((seq, payload))

    def _finish_reply(self, r: _Subscription) -> None:
        kind, reply = r.syncing, r.reply
        r.syncing, r.reply, r.attempts = "", [], 0
        if kind == "snapshot":
            self._apply_snapshot(r, reply)
        else:
            self._apply_replay(r, reply)

    def _apply_snapshot(self, r: _Subscription, reply: list[tuple[int, bytes]]) -> None:
        if not reply:
            # The publisher keeps no snapshots (vLLM): rebuild from its replay buffer.
            r.snapshot_supported = False
            self._resync(r)
            return
        batches = [self._decode(r, payload) for _, payload in reply]
        if any(b is None for b in batches) or len({s for s, _ in reply}) != 1:
            self._give_up(r)
            return
        seq = reply[0][0]
        for b in batches:
            self._deliver(r, seq, b, "snapshot")  # type: ignore[arg-type]
        r.last_seq = seq
        self._drain_pending(r)

    def _apply_replay(self, r: _Subscription, reply: list[tuple[int, bytes]]) -> None:
        before = r.last_seq
        first_seq = next((seq for seq, _ in reply if seq > r.last_seq), None)
        if first_seq is not None and first_seq > r.last_seq + 1 and not r.snapshot_supported:
            # The buffer no longer reaches back and there is no snapshot to ask for: what
            # the hole changed is unknowable, so restart the view at the buffer's start.
            if r.last_seq >= 0 or r.stats.delivered:
                self._reset(r)
            r.last_seq = first_seq - 1
        for seq, payload in reply:
            if seq <= r.last_seq:
                continue
            batch = self._decode(r, payload) if seq == r.last_seq + 1 else None
            if batch is None:
                break  # the replay does not reach back far enough, or holds garbage
            self._deliver(r, seq, batch, "replay")
        first = next(((seq, b) for seq, b in r.pending if seq > r.last_seq), None)
        if first is not None and (first[0] != r.last_seq + 1 or first[1] is None):
            newest = max((seq for seq, _ in reply), default=-1)
            if r.last_seq == newest > before:
                # A newer hole, lost after the buffer was read (batches kept arriving while
                # the reply was on its way): the next replay holds it.
                r.stats.gaps += 1
                self._request(r, "replay", r.last_seq + 1)
                return
            # Still a hole: the engine's buffer no longer holds it.
            if r.snapshot_supported:
                self._request(r, "snapshot", SNAPSHOT_REQUEST)
            else:
                self._give_up(r)
            return
        self._drain_pending(r)

    # -- delivery ----------------------------------------------------------------------
    def _deliver(self, r: _Subscription, seq: int, batch: EventBatch, source: Source) -> None:
        r.last_seq = seq
        r.stats.delivered += 1
        self._emit(r, ReplicaBatch(r.replica_id, seq, batch, source))

    def _emit(self, r: _Subscription, item: ReplicaBatch) -> None:
        if self._on_batch is not None:
            try:
                self._on_batch(item)
            except Exception:
                log.exception("on_batch callback failed for replica %s", r.replica_id)
        for loop, q in self._async_sinks:
            loop.call_soon_threadsafe(q.put_nowait, item)
