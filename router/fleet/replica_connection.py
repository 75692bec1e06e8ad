"""A front door's end of the data plane (:mod:`kvroute.events.dataplane_wire`): one connection
per replica, requests out, each step's deltas in, failures noticed.

Why the shape:
- The sockets are plain (not ``zmq.asyncio``) DEALERs read from the event loop's own reader
  callback: one wake-up drains every message that arrived and hands each delta to its
  request's :class:`InFlightRequest`, with no future, task or coroutine per message.
- An :class:`InFlightRequest` is one request's single slot: deltas that arrive while its reader is
  busy are merged into the one waiting, so a slow client costs a bounded buffer (its
  text so far), never a queue per token (vLLM's ``RequestOutputCollector`` does the same).
- A replica is lost when its connection drops (a socket monitor: a killed process closes
  its TCP connections at once), when it is silent past ``SILENCE_TIMEOUT_S`` (its I/O
  thread heartbeats; a host that vanished), when a heartbeat names another incarnation, or
  when the front door's Ray monitor says so. Every request still in flight then fails with
  :class:`ReplicaLostError`; exactly one -- the most recently sent, the likeliest to have
  been in the step that crashed -- is marked as a possible cause (see :mod:`.quarantine`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvroute.events import dataplane_wire as dp
from kvroute.events.load import LoadReport
from kvroute.events.replica_api import (
    GenerateDelta,
    GenerateRequest,
    ReplicaLostError,
    delta_error,
    merge_deltas,
)
from kvroute.events.transport.sockets import configure_socket

log = logging.getLogger(__name__)

# Plain ints: ``zmq.POLLIN`` is an IntFlag, and ``int & IntFlag`` builds a flag through
# Python's enum machinery, on every wake-up of the loop, twice; ``int & int`` builds nothing.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
INF = float("inf")


class InFlightRequest:
    """One request in flight on one connection: its pending delta (merged while unread) or
    the error that ended it."""

    __slots__ = ("_loop", "_waiter", "delta", "done", "error", "push", "request_id", "seq")

    def __init__(
        self, request_id: str, seq: int, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """``loop``: the one it is awaited on, when known (else looked up per wait)."""
        self._loop = loop
        self.request_id = request_id
        self.seq = seq  # send order on its connection: the youngest is the likeliest culprit
        self.delta: GenerateDelta | None = None
        self.error: BaseException | None = None
        self.done = False  # a finished delta or an error arrived: nothing more will
        self._waiter: asyncio.Future[None] | None = None
        # Takes a delta at once, from the connection's callback, while the reader waits
        # with nothing pending (False: it cannot; the delta waits for the reader as usual).
        self.push: Callable[[GenerateDelta], bool] | None = None

    def put(self, delta: GenerateDelta) -> None:
        push = self.push
        if (
            push is not None
            and self._waiter is not None  # the reader waits, with nothing unread: in order
            and self.delta is None
            and not delta.finished  # the end (a failure is one) goes through the reader
            and push(delta)
        ):
            return
        self.delta = delta if self.delta is None else merge_deltas(self.delta, delta)
        if delta.finished:
            self.done = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self.error, self.done = exc, True
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def next(self) -> GenerateDelta:
        """The deltas since the last call, merged; raises the error that ended the request
        once its deltas are taken. Call again only after a delta that is not finished."""
        while self.delta is None:
            if self.error is not None:
                raise self.error
            self._waiter = (self._loop or asyncio.get_running_loop()).create_future()
            await self._waiter
        delta, self.delta = self.delta, None
        return delta


def fail_flights(flights: dict[str, InFlightRequest], replica_id: str, why: str) -> int:
    """Fails (and forgets) every flight of a lost replica, the youngest marked as the
    possible cause (the last request sent is the likeliest to have killed it); how many."""
    lost = list(flights.values())
    flights.clear()
    youngest = max(lost, key=lambda f: f.seq, default=None)
    for f in lost:
        f.fail(
            ReplicaLostError(
                f"replica {replica_id}: {why}", maybe_cause=f is youngest, alone=len(lost) == 1
            )
        )
    return len(lost)


class ReplicaConnectionBase:
    """What every kind of replica connection (this module's, and
    :class:`~kvroute.router.backends.connection.HttpReplicaConnection`) shares: how it is
    lost. A subclass sets these attributes and closes its own transport in ``close``."""

    replica_id: str
    lost: str | None  # why, once lost
    flights: dict[str, InFlightRequest]
    on_lost: Callable[[str, str], None]
    lost_noun = "replica"  # what the log line calls it

    def close(self) -> None:
        raise NotImplementedError

    def mark_lost(self, why: str, notify: bool = True) -> None:
        """The replica is gone: every flight fails (one marked as the possible cause), the
        connection is closed; ``notify``: call ``on_lost`` (not when the front door itself
        drops the replica)."""
        if self.lost is not None:
            return
        self.lost = why
        n = fail_flights(self.flights, self.replica_id, why)
        logging.getLogger(type(self).__module__).warning(
            "%s %s lost (%s); %d request(s) in flight", self.lost_noun, self.replica_id, why, n
        )
        self.close()
        if notify:
            self.on_lost(self.replica_id, why)


_connection_ids = itertools.count()


class ReplicaConnection(ReplicaConnectionBase):
    """One DEALER to one replica's data plane; used from one event loop only."""

    def __init__(
        self,
        replica_id: str,
        endpoint: str,
        incarnation: str,
        client_id: str,
        on_lost: Callable[[str, str], None],
        context: zmq.Context | None = None,
        on_load: Callable[[str, LoadReport], None] | None = None,
    ) -> None:
        """``on_lost(replica_id, why)`` runs once, when the connection finds the replica
        gone (after every flight has failed); ``on_load(replica_id, report)`` with each
        load report the replica pushes."""
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.incarnation = incarnation
        self.on_lost = on_lost
        self.on_load = on_load
        self.loads = 0  # load reports received: the replica pushes its load (version >= 2)
        self.lost: str | None = None  # why, once lost
        self.flights: dict[str, InFlightRequest] = {}
        self.malformed = 0  # messages that did not decode, skipped
        self.callback_errors = 0  # messages a callback failed on (logged), skipped
        self._seq = itertools.count()
        self._loop = asyncio.get_running_loop()
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        configure_socket(self._sock)
        # A fresh routing id per connection: a replica never mistakes a reconnected front
        # door for the old connection, whose requests it aborts once a send to it fails.
        routing_id = f"{client_id}-{next(_connection_ids)}"
        self._sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self.last_heard = time.monotonic()  # the grace for a first word starts now
        self._draining = False
        self._loop.add_reader(self._sock.getsockopt(zmq.FD), self._on_readable)
        self._loop.add_reader(self._monitor.getsockopt(zmq.FD), self._on_monitor)
        self._send(dp.HELLO, dp.encoder.encode(dp.Hello(client_id)))

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> InFlightRequest:
        """Sends the request; its deltas arrive in the returned flight."""
        flight = InFlightRequest(req.request_id, next(self._seq), self._loop)
        if self.lost is not None:
            flight.fail(ReplicaLostError(f"replica {self.replica_id}: {self.lost}"))
            return flight
        self.flights[req.request_id] = flight
        self._send(dp.ADD, dp.encoder.encode(req))
        return flight

    def abort(self, request_id: str) -> None:
        """Ends a request on the replica (its flight is dropped: nothing more is read)."""
        if self.flights.pop(request_id, None) is not None and self.lost is None:
            self._send(dp.ABORT, dp.encoder.encode([request_id]))

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """The request's deltas, the last finished; an error delta raises its exception
        (:func:`delta_error`). Leaving early aborts the request on the replica."""
        flight = self.submit(req)
        try:
            while True:
                delta = await flight.next()
                exc = delta_error(delta, self.replica_id)
                if exc is not None:
                    raise exc
                yield delta
                if delta.finished:
                    return
        finally:
            if not flight.done or flight.delta is not None:
                self.abort(req.request_id)
            else:
                self.flights.pop(req.request_id, None)

    # -- liveness ----------------------------------------------------------------------------
    def silence_due_in(self, now: float) -> float:
        """Seconds until :meth:`check_silence` could find this replica silent (the
        monitor's next round need not come sooner for it)."""
        return self.last_heard + dp.SILENCE_TIMEOUT_S - now if self.lost is None else INF

    def check_silence(self, now: float) -> None:
        """Lost when nothing (not even a heartbeat) came for ``SILENCE_TIMEOUT_S``."""
        if self.lost is None and now - self.last_heard > dp.SILENCE_TIMEOUT_S:
            self.mark_lost(f"silent for {now - self.last_heard:.1f} s")

    def close(self) -> None:
        for sock in (self._sock, self._monitor):
            if not sock.closed:
                self._loop.remove_reader(sock.getsockopt(zmq.FD))
        if not self._monitor.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)

    # -- the loop's reader callbacks -----------------------------------------------------------
    def _send(self, kind: bytes, payload: bytes) -> None:
        try:
            # Copied: pyzmq's zero-copy send costs more below tens of kB.
            self._sock.send_multipart((kind, payload), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # its queue is full: the replica stopped reading
            self.mark_lost(f"cannot send ({exc})")
            return
        # A send may consume the socket's edge-triggered read signal: if input is waiting,
        # read it on the next turn of the loop (asking costs less than a callback per send).
        if not self._draining and self._sock.getsockopt(_EVENTS) & _POLLIN:
            self._draining = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        self._draining = False
        sock = self._sock
        if sock.closed:
            return
        flights = self.flights
        # Asked, not tried: an exception per drained socket costs more than the question.
        while not sock.closed and sock.getsockopt(_EVENTS) & _POLLIN:
            try:
                kind, payload = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except ValueError:  # not two frames
                self.malformed += 1
                continue
            self.last_heard = time.monotonic()
            try:
                if kind == dp.OUTPUTS:
                    for delta in dp.decode_outputs(payload).deltas:
                        flight = flights.get(delta.request_id)
                        if flight is None:  # aborted here; its last deltas were in flight
                            continue
                        if delta.finished:
                            del flights[delta.request_id]
                        try:
                            flight.put(delta)
                        except Exception as exc:  # its own failure, never the connection's
                            self._fail_flight(delta.request_id, flight, exc)
                elif kind == dp.LOAD:
                    report = dp.decode_load(payload)
                    self.loads += 1
                    if self.on_load is not None:
                        self.on_load(self.replica_id, report)
                elif kind == dp.HEARTBEAT:
                    beat = dp.decode_heartbeat(payload)
                    if beat.incarnation != self.incarnation:
                        self.mark_lost(f"a new process ({beat.incarnation[:8]}) answers")
                        return
                else:
                    self.malformed += 1
            except msgspec.DecodeError:
                self.malformed += 1
                log.warning("replica %s: skipped a malformed data-plane message",
                            self.replica_id)  # fmt: skip
            except Exception:  # a callback's bug: an exception out of here would stop
                # this connection's reads for good (its socket's signal is edge-triggered)
                self.callback_errors += 1
                log.exception("replica %s: a data-plane message failed", self.replica_id)

    def _fail_flight(self, request_id: str, flight: InFlightRequest, exc: Exception) -> None:
        """A delta its flight could not take fails that request alone; the replica forgets it."""
        log.error("request %s: its delta failed on arrival", request_id, exc_info=exc)
        if self.flights.pop(request_id, None) is not None:
            self._send(dp.ABORT, dp.encoder.encode([request_id]))
        flight.fail(exc)

    def _on_monitor(self) -> None:
        mon = self._monitor
        while not mon.closed:
            try:
                event = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._on_readable()  # what arrived before the drop (an engine's last word)
                self.mark_lost("its connection dropped")
                return
