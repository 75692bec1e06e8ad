"""The transfer plane: leased blocks from a source replica to a puller over ZeroMQ TCP.

The source runs a :class:`KVPlaneServer` (a ROUTER on a thread of its own, ``kvr-kvsend``)
in front of its :class:`~.sender.KVSender`; a puller reaches any number of sources through
one :class:`PlaneLink` (a DEALER per source endpoint). The frames (kind byte first, msgpack
bodies, :mod:`kvroute.events.kv_transfer`)::

    puller -> source   [KIND_PULL, Pull]  |  [KIND_KEEP, Keep]  |  [KIND_DONE, Done]
    source -> puller   [KIND_BLOCK, BlockHeader, payload] ... then [KIND_END, PullEnd]

How a pull is bounded: the puller waits for each frame only until its deadline, and a pull
that does not end with its PullEnd (the deadline passed, a frame out of order or short, the
sink refused a block, the link closed) discards its socket, so no late frame of it can
reach a later pull (frames of another pull_id are dropped anyway). The server's sends to a
puller that went away fail at once (ROUTER_MANDATORY), and to one that stopped reading
fail after :data:`SEND_TIMEOUT_S`: either ends that pull, never the thread.

Why a block's bytes never change once queued: a zero-copy send (the default) keeps a
reference to them until ZeroMQ's I/O thread has written them, so the sender reads each
block into a buffer of its own (:meth:`~.sender.KVSender.serve`'s ``buffers``), which goes
back to the server's pool only once its send's tracker says ZeroMQ is done with it (fresh
buffers each time cost as much in first-touch page faults as the copy saved).
``zero_copy=False`` copies each block into its ZeroMQ message instead, from one reused
buffer; ``benchmarks/bench_kv_transfer.py`` measures both.

Invariants:
- a ZeroMQ socket is used by one thread only: the server's by its thread (close joins it
  first); each of the link's by the thread that made it (``threading.local``), and by
  :meth:`PlaneLink.close` only once no call is in flight;
- a pull that returns without its PullEnd leaves no socket behind that could deliver a
  frame of it later.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import torch
import zmq

from kvroute.events.kv_transfer import (
    KIND_BLOCK,
    KIND_DONE,
    KIND_END,
    KIND_KEEP,
    KIND_PULL,
    PULL_FAILED,
    BlockHeader,
    Done,
    Keep,
    KVSource,
    Pull,
    PullEnd,
)
from kvroute.events.transport.threads import Waker, name_native_thread

from .sender import BlockSink, KVSender

log = logging.getLogger(__name__)

# Blocks queued to one puller before the server's send waits (a block is 0.7-2 MiB).
SEND_HWM = 16
# Block buffers a zero-copy server keeps for reuse once ZeroMQ has sent them.
SPARE_BUFFERS = 2 * SEND_HWM
# How long the server waits to queue one block to a puller that stopped reading.
SEND_TIMEOUT_S = 2.0
# How long a Keep or Done on a socket of its own is tried after the socket is closed.
TELL_LINGER_S = 1.0
# Why a pull ended on the puller's side, beside the source's PULL_* reasons.
LINK_TIMEOUT = "timeout"  # the deadline passed (a slow, dead or unreachable source)
LINK_BROKEN = "broken"  # a frame out of order, short, or not a block
LINK_CLOSED = "closed"  # the link is closing
LINK_REFUSED = "refused"  # the sink refused a block (its size or checksum)

_encoder = msgspec.msgpack.Encoder()
_decode_pull = msgspec.msgpack.Decoder(Pull).decode
_decode_keep = msgspec.msgpack.Decoder(Keep).decode
_decode_done = msgspec.msgpack.Decoder(Done).decode
_decode_header = msgspec.msgpack.Decoder(BlockHeader).decode
_decode_end = msgspec.msgpack.Decoder(PullEnd).decode


def advertised(last_endpoint: str, host: str | None) -> str:
    """The endpoint others connect to: the bound one's port on ``host`` (None: the bound
    host; a wildcard one, 0.0.0.0 or ::, reads as loopback: pass ``host`` across hosts)."""
    bound_host, _, port = last_endpoint.removeprefix("tcp://").rpartition(":")
    if host is None:
        host = "127.0.0.1" if bound_host in ("0.0.0.0", "*", "[::]") else bound_host
    return f"tcp://{host}:{port}"


class KVPlaneServer:
    """Serves ``sender``'s leased blocks over a ROUTER until :meth:`close`; pulls in turn."""

    def __init__(
        self,
        sender: KVSender,
        bind: str = "tcp://127.0.0.1:*",
        *,
        advertise_host: str | None = None,
        context: zmq.Context | None = None,
        zero_copy: bool = True,
    ) -> None:
        from kvroute.events.transport.publisher import _bind

        self.sender = sender
        self.zero_copy = zero_copy
        # malformed: messages that did not decode, skipped; send_failures: pulls cut short
        # (the puller went away or stopped reading)
        keys = ("messages", "pulls", "keeps", "dones", "malformed", "send_failures")
        self.stats = dict.fromkeys(keys, 0)
        self._sock = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        _bind(self._sock, bind)
        self.endpoint = advertised(self._sock.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        sender.endpoint = self.endpoint
        # zero_copy: the block buffers ZeroMQ may still be sending (oldest first, with the
        # tracker that says when it is done), and those it is done with, for the next reads.
        self._sending: deque[tuple[zmq.MessageTracker, torch.Tensor]] = deque()
        self._spare: list[torch.Tensor] = []
        # Buffers handed to the sender and read into, not sent yet: in block order (the
        # sender reads a chunk of blocks before it sends the first).
        self._handed: deque[torch.Tensor] = deque()
        self._waker = Waker()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvr-kvsend", daemon=True)
        self._thread.start()

    def close(self, timeout: float = SEND_TIMEOUT_S + 1.0) -> None:
        """Stops the thread (a pull being served ends at its next block) and the socket."""
        if not self._running:
            return
        self._running = False
        self._waker.wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._sock.close(linger=0)
            self._waker.close()

    @property
    def alive(self) -> bool:  # the thread serves (tests: never wedged, never dead)
        return self._thread.is_alive()

    # -- the server's thread -----------------------------------------------------------------
    def _run(self) -> None:
        name_native_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        while self._running:
            ready = dict(poller.poll(1000))
            if self._waker.fd in ready:
                self._waker.drain()
            for _ in range(64):  # then look at the waker again
                if not self._running:
                    break
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:  # never seen; never the thread's death either
                    log.warning("KV plane: receive failed", exc_info=True)
                    break
                self.stats["messages"] += 1
                try:
                    self._handle(frames)
                except Exception:
                    self.stats["malformed"] += 1
                    log.warning("KV plane: skipped a malformed message", exc_info=True)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise ValueError(f"expected 3 frames, got {len(frames)}")
        peer, kind, body = frames
        if kind == KIND_PULL:
            self._serve(peer, _decode_pull(body))
        elif kind == KIND_KEEP:
            keep = _decode_keep(body)
            self.stats["keeps"] += 1
            self.sender.keep(keep.lease, keep.extend_s)
        elif kind == KIND_DONE:
            self.stats["dones"] += 1
            self.sender.done(_decode_done(body).lease)
        else:
            raise ValueError(f"unknown kind {kind!r}")

    def _serve(self, peer: bytes, pull: Pull) -> None:
        self.stats["pulls"] += 1
        sock = self._sock
        cut = False  # the puller cannot be sent to (gone, or not reading)

        def sink(i: int, data: memoryview, digest: int) -> bool:
            nonlocal cut
            if not self._running:
                return False
            header = _encoder.encode(
                BlockHeader(pull_id=pull.pull_id, index=i, nbytes=len(data), digest=digest)
            )
            try:
                # EHOSTUNREACH (gone) or EAGAIN (not reading) come at the first frame
                sock.send(peer, zmq.SNDMORE)
                sock.send(KIND_BLOCK, zmq.SNDMORE)
                sock.send(header, zmq.SNDMORE)
                if not self.zero_copy:
                    sock.send(data)  # copied: the sender reads the next block into this buffer
                    return True
                tracker = sock.send(data, copy=False, track=True)
            except zmq.ZMQError:
                cut = True
                return False
            self._sending.append((tracker, self._handed.popleft()))
            return True

        buffers = self._buffer if self.zero_copy else None
        sent, reason = self.sender.serve(pull.lease, pull.start, pull.hashes, sink, buffers)
        while self._handed:  # read but never sent (the pull ended early): for the next
            buf = self._handed.popleft()
            if len(self._spare) < SPARE_BUFFERS:
                self._spare.append(buf)
        if cut:
            self.stats["send_failures"] += 1
            return
        if not self._running:
            reason = PULL_FAILED
        end = _encoder.encode(PullEnd(pull_id=pull.pull_id, sent=sent, reason=reason))
        try:
            sock.send_multipart([peer, KIND_END, end])
        except zmq.ZMQError:
            self.stats["send_failures"] += 1

    def _buffer(self) -> torch.Tensor:
        """A block buffer no send holds: one ZeroMQ is done with, else a new one (pages
        touched for the first time cost as much as the copy a zero-copy send saves)."""
        sending = self._sending
        while sending and sending[0][0].done:
            buf = sending.popleft()[1]
            if len(self._spare) < SPARE_BUFFERS:
                self._spare.append(buf)
        buf = self._spare.pop() if self._spare else self.sender.reader.buffer()
        self._handed.append(buf)
        return buf


class PlaneLink:
    """The puller's side (a :class:`~.fetcher.KVLink`): a DEALER per source endpoint and
    calling thread, made on first use; any thread may call it."""

    # The bytes a sink gets are a received frame's, valid as long as they are referenced:
    # RemoteFetcher keeps them rather than copy them (a copy into fresh memory halved the
    # pull's speed: bench_kv_transfer.py).
    durable_blocks = True

    def __init__(self, context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._local = threading.local()  # .socks: endpoint -> this thread's DEALER
        self._all: set[zmq.Socket] = set()  # every live socket of every thread
        self._cond = threading.Condition()
        self._busy = 0  # calls in flight (close waits for them)
        self._closed = False
        self._waker = Waker()  # wakes pulls waiting on a frame when the link closes
        self._ids = itertools.count(1)
        self.stats = {"pulls": 0, "blocks": 0, "bytes": 0, "timeouts": 0, "broken": 0, "stale": 0}

    def pull(
        self,
        source: KVSource,
        start: int,
        hashes: Sequence[bytes],
        sink: BlockSink,
        deadline_s: float,
    ) -> tuple[int, str]:
        if not self._enter():
            return 0, LINK_CLOSED
        try:
            return self._pull(source, start, hashes, sink, time.monotonic() + deadline_s)
        finally:
            self._exit()

    def keep(self, source: KVSource, extend_s: float) -> None:
        self._tell(source, KIND_KEEP, _encoder.encode(Keep(lease=source.lease, extend_s=extend_s)))

    def done(self, source: KVSource) -> None:
        self._tell(source, KIND_DONE, _encoder.encode(Done(lease=source.lease)))

    def close(self, timeout: float = 2.0) -> None:
        """Ends pulls in flight (LINK_CLOSED) and closes every socket; later calls do
        nothing. Sockets are closed only once no call is in flight (else left to exit)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._waker.wake()
            idle = self._cond.wait_for(lambda: self._busy == 0, timeout)
            if idle:
                for sock in self._all:
                    sock.close(linger=0)
                self._all.clear()
        if idle:
            self._waker.close()

    # -- the calling thread ------------------------------------------------------------------
    def _enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._busy += 1
            return True

    def _exit(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def _socket(self, endpoint: str, cached: bool = True) -> zmq.Socket | None:
        """This thread's DEALER to ``endpoint``, made if need be (``cached``: else None)."""
        socks = self._local.__dict__.setdefault("socks", {})
        sock = socks.get(endpoint)
        if sock is None and cached:
            sock = socks[endpoint] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, SEND_HWM * 2)
            sock.connect(endpoint)
            with self._cond:
                self._all.add(sock)
        return sock

    def _discard(self, endpoint: str) -> None:
        sock = self._local.socks.pop(endpoint)
        with self._cond:
            self._all.discard(sock)
        sock.close(linger=0)

    def _tell(self, source: KVSource, kind: bytes, body: bytes) -> None:
        """Keep or Done: on this thread's socket to the source if a pull left one, else on
        one of its own that ZeroMQ tries to deliver for TELL_LINGER_S after it is closed
        (so a source that died leaves no socket behind, reconnecting forever)."""
        if not source.endpoint or not self._enter():
            return
        try:
            sock = self._socket(source.endpoint, cached=False)
            if sock is not None:
                sock.send_multipart([kind, body], zmq.NOBLOCK)
                return
            once = self._ctx.socket(zmq.DEALER)
            once.connect(source.endpoint)
            once.send_multipart([kind, body], zmq.NOBLOCK)
            once.close(linger=int(TELL_LINGER_S * 1000))
        except zmq.Again:  # never reached: the lease expires at the source instead
            pass
        finally:
            self._exit()

    def _pull(
        self,
        source: KVSource,
        start: int,
        hashes: Sequence[bytes],
        sink: BlockSink,
        deadline: float,
    ) -> tuple[int, str]:
        if not source.endpoint:
            return 0, LINK_BROKEN
        self.stats["pulls"] += 1
        endpoint = source.endpoint
        sock = self._socket(endpoint)
        assert sock is not None
        pull_id = next(self._ids)
        ask = Pull(pull_id=pull_id, lease=source.lease, start=start, hashes=list(hashes))
        try:
            sock.send_multipart([KIND_PULL, _encoder.encode(ask)], zmq.NOBLOCK)
        except zmq.Again:
            self._discard(endpoint)
            return 0, LINK_TIMEOUT
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        got = 0
        ended = False  # its PullEnd came: nothing more of this pull is on its way
        try:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.stats["timeouts"] += 1
                        return got, LINK_TIMEOUT
                    if self._waker.fd in dict(poller.poll(max(1, int(left * 1000)))):
                        return got, LINK_CLOSED
                    continue
                kind = frames[0].bytes
                if kind == KIND_BLOCK and len(frames) == 3:
                    header = _decode_header(frames[1].bytes)
                    if header.pull_id != pull_id:
                        self.stats["stale"] += 1
                        continue
                    payload = frames[2].buffer
                    if header.index != got or len(payload) != header.nbytes:
                        break
                    if not sink(header.index, payload, header.digest):
                        return got, LINK_REFUSED
                    got += 1
                    self.stats["blocks"] += 1
                    self.stats["bytes"] += len(payload)
                elif kind == KIND_END and len(frames) == 2:
                    end = _decode_end(frames[1].bytes)
                    if end.pull_id != pull_id:
                        self.stats["stale"] += 1
                        continue
                    ended = True
                    return got, end.reason
                else:
                    break
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        finally:
            if not ended:  # frames of this pull may still come: never to the next one
                self._discard(endpoint)
        self.stats["broken"] += 1
        return got, LINK_BROKEN
