"""ZmqEventPublisher: one engine's block events on a PUB socket, with replay and snapshots.

Why the shape:
- ``publish()`` runs on the engine's step path. It assigns the sequence number, folds the
  batch into the publisher's :class:`BlockSet` and, when nothing is queued or being sent
  (the usual case), encodes and sends it there and then (``inline``, the default): waking
  the publisher's thread for it cost more CPU than the encoding and the send (a thread
  wake-up per step that stores a block; ``benchmarks/bench_replica_path.py``), as it did
  for the data plane's outputs. A batch that finds the thread sending waits in a bounded
  queue behind what it sends, so batches leave in seq order; with ``inline=False`` every
  batch goes through the queue (encoding off the caller's thread). When the queue is full
  the batch is dropped and counted -- its seq is still consumed, so every subscriber sees
  the gap and recovers by snapshot (the replay buffer never held it).
- The PUB socket is used by one thread at a time: the caller, under ``_lock`` and only
  while the thread is not sending, or the thread, while ``_sending`` (set under the lock).
  The lock's acquire and release are the memory barriers ZeroMQ asks of a socket that
  moves between threads.
- The :class:`BlockSet` is the integral of everything published, updated under the same
  lock that assigns seq; a snapshot copied under that lock is therefore exactly the state
  after batch ``seq`` -- no race with the engine, whatever the engine is doing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Literal

import zmq

from ..blockset import BlockSet, snapshot_events
from ..framing import END_MARKER, SNAPSHOT_REQUEST, pack_seq, unpack_seq
from ..wire import AllBlocksCleared, BatchEncoder, EventBatch, KVCacheEvent
from .threads import Waker, name_native_thread

log = logging.getLogger(__name__)

SNAPSHOT_CHUNK_BLOCKS = 4096


class ZmqEventPublisher:
    """PUB + ROUTER publisher of :class:`EventBatch` messages.

    ``endpoint`` / ``replay_endpoint`` are bound (``tcp://127.0.0.1:*`` picks a free port;
    the bound addresses are in :attr:`endpoint` and :attr:`replay_endpoint`).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = "tcp://*:5558",
        topic: str = "",
        *,
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
        heartbeat_interval: float | None = 1.0,
        data_parallel_rank: int | None = None,
        layout: Literal["array", "map"] = "array",
        context: zmq.Context | None = None,
        inline: bool = True,
    ) -> None:
        if buffer_steps < 1 or max_queue_size < 1:
            raise ValueError("buffer_steps and max_queue_size must be >= 1")
        self.topic = topic.encode()
        self.heartbeat_interval = heartbeat_interval
        self.data_parallel_rank = data_parallel_rank
        self.state = BlockSet()
        self.published = 0  # batches accepted by publish()
        self.sent = 0  # batches that went out on the PUB socket
        self.dropped = 0  # batches lost to a full queue
        self.replays_served = 0
        self.snapshots_served = 0
        self.malformed_requests = 0  # replay/snapshot requests ignored as garbage

        self._encoder = BatchEncoder(layout)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._inline = inline
        self._sending = False  # the thread holds a batch it took from the queue
        self._queue: queue.SimpleQueue[tuple[int, EventBatch]] = queue.SimpleQueue()
        self._max_queue = max_queue_size
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._last_send = time.monotonic()

        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind(self._pub, endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay is never silently truncated
            self._replay.setsockopt(zmq.LINGER, 0)
            _bind(self._replay, replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

        self._waker = Waker()
        self._idle = False
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvr-publisher", daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        """The seq of the newest batch published (-1 before the first)."""
        return self._next_seq - 1

    def publish(self, events: EventBatch | Sequence[KVCacheEvent]) -> int:
        """Sends one batch, or queues it behind one being sent. Never waits on the socket
        (a non-blocking send), only, briefly, for the lock (a snapshot copies the block set
        under it). Returns its seq (consumed even if dropped)."""
        if not self._running:
            raise RuntimeError("publisher is closed")
        if not isinstance(events, EventBatch):
            events = EventBatch(time.time(), list(events), self.data_parallel_rank)
        elif events.data_parallel_rank is None and self.data_parallel_rank is not None:
            events.data_parallel_rank = self.data_parallel_rank
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self.state.apply_batch(events)
            self.published += 1
            if self._inline and self._running and not self._sending and not self._queue.qsize():
                self._send(seq, events)  # nothing ahead of it: in order, on this thread
                return seq
            if self._queue.qsize() >= self._max_queue:
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8, ...: no log storm
                    log.warning("event queue full: %d batches dropped so far", self.dropped)
            else:
                self._queue.put((seq, events))
        if self._idle:  # only a sleeping thread needs the (GIL-releasing) wake-up syscall
            self._waker.wake()
        return seq

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch has gone out; True if it did within ``timeout``."""
        deadline = time.monotonic() + timeout
        while (self._queue.qsize() or self._sending) and time.monotonic() < deadline:
            time.sleep(0.0002)
        return self._queue.qsize() == 0 and not self._sending

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout``), stop the thread, close the sockets."""
        if not self._running:
            return
        self.flush(timeout)
        with self._lock:  # no inline send after this
            self._running = False
        self._waker.wake()
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._waker.close()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publisher thread --------------------------------------------------------------
    def _run(self) -> None:
        name_native_thread()
        poller = zmq.Poller()
        poller.register(self._waker.fd, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while self._running:
            timeout_ms = 0
            if not self._queue.qsize():
                # Announce the sleep, then look once more: publish() puts before it reads
                # _idle, so a batch is either seen here or followed by a wake-up.
                self._idle = True
                if not self._queue.qsize():
                    timeout_ms = 100
                    if self.heartbeat_interval:
                        idle = time.monotonic() - self._last_send
                        timeout_ms = max(0, int((self.heartbeat_interval - idle) * 1000))
            ready = dict(poller.poll(timeout_ms))
            self._idle = False
            if self._waker.fd in ready:
                self._waker.drain()
            # Bounded, so a producer that never pauses cannot starve replay requests.
            self._send_queued(limit=256)
            if self._replay is not None and self._replay in ready:
                self._serve_requests()
            if (
                self.heartbeat_interval
                and self._running
                and time.monotonic() - self._last_send >= self.heartbeat_interval
            ):
                self.publish(EventBatch(time.time(), [], self.data_parallel_rank))
                self._send_queued()
        self._send_queued()

    def _send_queued(self, limit: int | None = None) -> None:
        n = 0
        while limit is None or n < limit:
            n += 1
            with self._lock:
                try:
                    seq, batch = self._queue.get_nowait()
                except queue.Empty:
                    return
                self._sending = True  # publish() queues behind it meanwhile
            try:
                self._send(seq, batch)
            finally:
                with self._lock:
                    self._sending = False

    def _send(self, seq: int, batch: EventBatch) -> None:
        """Encodes and sends one batch and keeps it for replays. By whichever thread may use
        the socket now (see the module's docstring)."""
        try:
            payload = self._encoder.encode(batch)
            self._pub.send_multipart((self.topic, pack_seq(seq), payload))  # copied: see dataplane
            self._buffer.append((seq, payload))
            self.sent += 1
            self._last_send = time.monotonic()
        except Exception:  # never let one bad batch stop the stream
            log.exception("failed to publish batch %d", seq)

    def _serve_requests(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                self.malformed_requests += 1
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            ident = frames[0]
            try:
                start = unpack_seq(frames[2])
            except ValueError:
                self.malformed_requests += 1
                log.warning("ignoring replay request with a bad sequence frame")
                continue
            if start < 0 and start != SNAPSHOT_REQUEST:
                self.malformed_requests += 1
                log.warning("ignoring replay request for sequence %d", start)
                continue
            # Batches queued before the request must be in the buffer before we answer, or
            # a replay could miss a batch the subscriber will never see live. (Only those:
            # draining until empty could starve the request behind a busy engine.)
            self._send_queued(limit=self._queue.qsize())
            if start == SNAPSHOT_REQUEST:
                self._serve_snapshot(ident)
            else:
                self._serve_replay(ident, start)

    def _serve_replay(self, ident: bytes, start: int) -> None:
        send = self._replay.send_multipart  # type: ignore[union-attr]
        with self._lock:  # an inline send appends under it
            buffered = list(self._buffer)
        for seq, payload in buffered:
            if seq >= start:
                send((ident, b"", self.topic, pack_seq(seq), payload), copy=False)
        send((ident, *END_MARKER))
        self.replays_served += 1

    def _serve_snapshot(self, ident: bytes) -> None:
        with self._lock:
            records, lower = self.state.records(), self.state.tier_records()
            seq = self._next_seq - 1
        events = snapshot_events(records, *lower.values())  # every tier, device first
        send = self._replay.send_multipart  # type: ignore[union-attr]
        seq_raw = pack_seq(seq)
        first: list = [AllBlocksCleared()]
        for i in range(0, max(len(events), 1), SNAPSHOT_CHUNK_BLOCKS):
            chunk = first + events[i : i + SNAPSHOT_CHUNK_BLOCKS]
            first = []
            payload = self._encoder.encode(EventBatch(time.time(), chunk, self.data_parallel_rank))
            send((ident, b"", self.topic, seq_raw, payload), copy=False)
        send((ident, *END_MARKER))
        self.snapshots_served += 1


def _bind(sock: zmq.Socket, endpoint: str, wait: float = 2.0) -> None:
    """Bind, waiting briefly for a port that a just-closed socket of this process is still
    releasing (ZeroMQ unbinds asynchronously): an engine restarted in-process rebinds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)
