"""DataPlaneServer: a replica's end of the data plane (:mod:`kvroute.events.dataplane_wire`).

Why the shape:
- One ROUTER socket, shared under a lock by two threads: the I/O thread receives requests
  and sends heartbeats and load reports; the engine thread sends each step's outputs itself,
  at the end of the step. A hand-off to the I/O thread instead costs a thread wake-up per
  step, more CPU than encoding and sending the message and most of a replica's per-step
  cost outside the model at low concurrency (``benchmarks/bench_output_handoff.py``
  compares both ways; BENCHMARKS.md). The send
  is non-blocking, and the lock is held for socket work (a batch of receives, a round of
  heartbeats or load reports, a send and what a failed one sets off), never while a
  request is decoded or submitted.
- ZeroMQ sockets are not thread-safe, but one may be used from several threads with a full
  memory barrier between uses (the lock). So the I/O thread never blocks in poll() on the
  socket itself: it waits on the socket's edge-triggered ``FD``. Any operation on the
  socket may consume that edge, so whoever used it last reads ``EVENTS`` afterwards and,
  if input waits, makes sure the I/O thread looks (the engine thread wakes it by a pipe).
- Outputs are grouped per front door: one message per front door per step, whatever the
  number of its requests in that step.
- A send to a front door that has gone fails (ROUTER_MANDATORY), and so does one to a front
  door that stopped reading for a high-water mark's worth of steps: either way its requests
  are aborted in the engine, so no step computes for nobody.
- Bad input (a frame that does not decode, an unknown kind) is counted and skipped; a
  request that decodes but can never run is refused to its sender alone.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvroute.events import dataplane_wire as dp
from kvroute.events.bounds import check_sampling
from kvroute.events.load import LoadReport
from kvroute.events.replica_api import GenerateDelta
from kvroute.events.transport.sockets import configure_socket
from kvroute.events.transport.threads import Waker, name_native_thread

if TYPE_CHECKING:
    from ..engine.replica_engine import ReplicaEngine

log = logging.getLogger(__name__)


class _FrontDoorSink:
    """One front door's requests on this replica: the engine thread delivers into
    ``pending``; ``flush`` sends the step's deltas as one message."""

    __slots__ = ("client", "pending", "received", "server")
    deltas = True  # the engine builds each GenerateDelta itself (see LLMEngine.add_request)

    def __init__(self, server: DataPlaneServer, client: bytes) -> None:
        self.server = server
        self.client = client
        self.pending: list[GenerateDelta] = []
        self.received: dict[str, float] = {}  # request id -> when it arrived (first delta)

    def deliver(self, request_id: str, item: GenerateDelta | BaseException) -> bool:
        delta = _failure_delta(request_id, item) if isinstance(item, BaseException) else item
        started = self.received.pop(request_id, None)
        if started is not None:
            delta.replica_ttft_s = time.perf_counter() - started
        self.pending.append(delta)
        return True

    def flush(self) -> None:
        if self.pending:
            deltas, self.pending = self.pending, []
            self.server.send_outputs(self.client, deltas)


class DataPlaneServer:
    """Binds ``endpoint`` (``tcp://127.0.0.1:*`` picks a port: see :attr:`endpoint`) and
    serves front doors for ``engine`` until :meth:`close`."""

    def __init__(
        self,
        engine: ReplicaEngine,
        endpoint: str,
        incarnation: str,
        *,
        context: zmq.Context | None = None,
    ) -> None:
        from kvroute.events.transport.publisher import _bind

        self.engine = engine
        self.incarnation = incarnation
        self.requests = 0  # requests received
        self.messages_sent = 0  # output messages sent (one per front door per step)
        self.malformed = 0  # frames that did not decode, skipped
        self.clients_dropped = 0  # front doors gone or stuck: their requests aborted
        self._sinks: dict[bytes, _FrontDoorSink] = {}
        self._last_sent: dict[bytes, float] = {}
        # Held for each use of the socket, by either thread (see the module's docstring).
        # Re-entrant: a request submitted to an engine that has died is refused at once,
        # by a send from inside the I/O thread's own handling.
        self._lock = threading.RLock()
        self._heartbeat_due = 0.0  # no front door is due a heartbeat before this
        self._load_moves_until = 0.0  # a request or abort came: the load moves (short sleeps)
        self._load_clients: set[bytes] = set()  # front doors that read LOAD (version >= 2)
        self._load_sent: LoadReport | None = None  # the engine's last report sent, and when
        self._load_sent_at = 0.0
        self._heartbeat = dp.encoder.encode(dp.Heartbeat(incarnation))
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        configure_socket(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        _bind(self._sock, endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._fd: int = self._sock.getsockopt(zmq.FD)
        self._waker = Waker()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvr-dataplane", daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------
    def send_outputs(self, client: bytes, deltas: list[GenerateDelta]) -> None:
        """One step's deltas for one front door, sent now (from the thread that made them)."""
        payload = dp.encoder.encode(dp.StepOutputs(deltas))
        with self._lock:
            if not self._running or client not in self._sinks:
                return  # closed, or the front door was dropped: its requests are aborted
            self._send(client, dp.OUTPUTS, payload)
            # The send may have taken the edge that would wake the I/O thread. (Under the
            # lock: close() closes the waker only once it has seen _running cleared.)
            if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._waker.wake()

    # -- any thread ------------------------------------------------------------------------
    def close(self, timeout: float = 2.0) -> None:
        if not self._running:
            return
        with self._lock:
            self._running = False
        self._waker.wake()
        self._thread.join(timeout)
        with self._lock:
            self._sock.close(linger=0)
        self._waker.close()

    # -- the I/O thread ----------------------------------------------------------------------
    def _run(self) -> None:
        name_native_thread()
        poller = zmq.Poller()
        poller.register(self._fd, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        interval = dp.HEARTBEAT_INTERVAL_S
        while self._running:
            frames = self._receive()
            self._send_load()
            self._send_heartbeats(interval)
            with self._lock:  # after this thread's own sends: see the module's docstring
                if not self._running:
                    break
                waiting = self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
            if frames or waiting:
                continue  # more may be queued: look again before sleeping
            # An idle replica's load changes only once the engine takes a request that just
            # came: short sleeps until then, or one that starts and ends within a heartbeat
            # is never reported (the router would see an idle replica that is busy).
            now = time.monotonic()
            changed = now < self._load_moves_until or self.engine.load is not self._load_sent
            wait = dp.LOAD_INTERVAL_S if changed else interval
            wait = min(wait, self._heartbeat_due - now)  # the earliest heartbeat
            ready = dict(poller.poll(max(0, math.ceil(wait * 1000))))
            if self._waker.fd in ready:
                self._waker.drain()

    def _receive(self, limit: int = 64) -> int:
        """Takes up to ``limit`` messages under the lock, then handles them outside it (so
        the engine's sends never wait on a decode); how many it took."""
        batch: list[list[bytes]] = []
        with self._lock:
            if not self._running:
                return 0
            recv = self._sock.recv_multipart
            for _ in range(limit):  # bounded: outputs must not wait behind a flood
                try:
                    batch.append(recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        for frames in batch:
            try:
                self._handle(frames)
            except Exception:  # never let one bad message stop the thread
                self.malformed += 1
                log.warning("data plane: skipped a malformed message", exc_info=True)
        return len(batch)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise ValueError(f"expected 3 frames, got {len(frames)}")
        client, kind, payload = frames
        if kind in (dp.ADD, dp.ABORT):
            self._load_moves_until = time.monotonic() + dp.HEARTBEAT_INTERVAL_S
        if kind == dp.ADD:
            self._add(client, payload)
        elif kind == dp.ABORT:
            for rid in dp.decode_abort(payload):
                self.engine.abort(rid)
        elif kind == dp.HELLO:
            hello = dp.decode_hello(payload)
            log.info("data plane: front door %s connected", hello.client_id)
            self._sink(client)
            self._send(client, dp.HEARTBEAT, self._heartbeat)
            if hello.version >= 2:
                self._load_clients.add(client)
                self._load_sent = None  # the newcomer hears the load at once
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _sink(self, client: bytes) -> _FrontDoorSink:
        with self._lock:  # the engine thread reads _sinks in send_outputs
            sink = self._sinks.get(client)
            if sink is None:
                sink = self._sinks[client] = _FrontDoorSink(self, client)
                self._last_sent[client] = time.monotonic()
            return sink

    def _add(self, client: bytes, payload: bytes) -> None:
        sink = self._sink(client)
        try:
            req = dp.decode_request(payload)
            check_sampling(req.sampling)  # checked when built; again, whatever way it came
        except (ValueError, TypeError, msgspec.ValidationError) as exc:
            rid = _request_id_of(payload)
            if rid is None:
                raise
            why = f"request rejected: {exc}"
            self.send_outputs(client, [_failure_delta(rid, ValueError(why))])
            return
        self.requests += 1
        sink.received[req.request_id] = time.perf_counter()
        self.engine.submit(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            sink,
            cache_salt=req.cache_salt,
            lora_name=req.lora_name,
            resume=req.resume,
            tenant=req.tenant,
            kv_handoff=req.kv_handoff,
            kv_source=req.kv_source,
            priority=req.priority,
        )

    def _send(self, client: bytes, kind: bytes, payload: bytes) -> None:
        """From either thread (the lock is re-entrant: a caller may already hold it)."""
        with self._lock:
            if not self._running:
                return
            try:
                # Copied: pyzmq's zero-copy send costs more below tens of kB.
                self._sock.send_multipart((client, kind, payload), zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # gone (EHOSTUNREACH) or stuck at its HWM (EAGAIN)
                self._drop(client, exc)
                return
            self.messages_sent += 1
            self._last_sent[client] = time.monotonic()

    def _send_load(self) -> None:
        """The load to every front door that reads it: at most every ``LOAD_INTERVAL_S``
        while it changes, every ``HEARTBEAT_INTERVAL_S`` while it does not (a router holds
        a report for a second only)."""
        report = self.engine.load  # a new object each step
        if not self._load_clients:
            return
        now = time.monotonic()
        wait = dp.LOAD_INTERVAL_S if report is not self._load_sent else dp.HEARTBEAT_INTERVAL_S
        if now - self._load_sent_at < wait:
            return
        payload = dp.encoder.encode(report)
        with self._lock:
            for client in list(self._load_clients):
                self._send(client, dp.LOAD, payload)
        self._load_sent, self._load_sent_at = report, now

    def _drop(self, client: bytes, exc: zmq.ZMQError) -> None:
        sink = self._sinks.pop(client, None)
        self._last_sent.pop(client, None)
        self._load_clients.discard(client)
        if sink is None:
            return
        self.clients_dropped += 1
        if exc.errno == zmq.EAGAIN:  # connected but not reading: worth an operator's look
            log.warning("data plane: a front door stopped reading; aborting its requests")
        else:  # it closed its connection (stopped, restarted, crashed)
            log.info("data plane: a front door is gone (%s); aborting its requests", exc)
        self.engine.abort_sink(sink)

    def _send_heartbeats(self, interval: float) -> None:
        """To each front door that heard nothing for ``interval``. The front doors are
        walked only when the earliest can be due (a send only moves a due time later; a new
        front door's is ``interval`` away)."""
        now = time.monotonic()
        if now < self._heartbeat_due:
            return
        with self._lock:
            for client, last in list(self._last_sent.items()):
                if now - last >= interval:
                    self._send(client, dp.HEARTBEAT, self._heartbeat)
            self._heartbeat_due = min(self._last_sent.values(), default=now) + interval


def _failure_delta(request_id: str, exc: BaseException) -> GenerateDelta:
    """The last delta of a request refused (ValueError: it can never run here) or ended by
    the engine's failure (``EngineDeadError``, suspect or not)."""
    from ..engine.replica_engine import EngineDeadError

    if isinstance(exc, EngineDeadError):
        failure = "suspect" if exc.suspect else "dead"
        text = str(exc)
    else:
        failure = "invalid"
        text = str(exc) if str(exc).startswith("request") else f"request rejected: {exc}"
    return GenerateDelta(
        request_id=request_id,
        delta_token_ids=[],
        finished=True,
        finish_reason="abort" if failure != "invalid" else "error",
        error=text.splitlines()[0] if text else None,
        failure=failure,
    )


def _request_id_of(payload: bytes) -> str | None:
    """The request id of an ADD that failed to decode as a whole, to refuse it by name."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None
