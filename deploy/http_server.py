"""The front door's HTTP server: uvicorn (h11), with a deadline on every request head.

Why: uvicorn arms no timer on a new connection, and cancels its keep-alive timer on the
first byte of the next request. A client that connects and never completes its request
head (slowloris: a header line every few seconds) holds its connection, socket and buffers
for as long as it likes, and enough of them exhaust the server's file descriptors. Here:

- a fresh connection that sends nothing is closed after ``idle_timeout_s``, as a kept-alive
  idle one is (the same keep-alive a load balancer relies on);
- once the first byte of a request head arrives, the whole head must arrive within
  ``head_timeout_s``, or the connection is closed;
- the body then has its own deadline in the app (a 408: :mod:`kvroute.router.intake`);
- a connection whose response ended incomplete is aborted, not closed: its unsent data is
  discarded rather than waited on.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 75  # past a load balancer's idle timeout (AWS ALB: 60 s), see uvicorn_config


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with an idle deadline for fresh connections and a deadline for
    each request head (class attributes: set on a subclass, see :func:`uvicorn_config`)."""

    idle_timeout_s: float = KEEP_ALIVE_S
    head_timeout_s: float = 30.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _AbortIfIncomplete(transport, self)  # type: ignore[assignment]
        self._head_started = False
        self._arm(self.idle_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head() and not self._head_started:
            self._head_started = True  # the clock for this head starts at its first byte
            self._arm(self.head_timeout_s)
        super().data_received(data)
        if not self._awaiting_head():  # the head is in: the app and keep-alive take over
            self._head_started = False
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.close()


class _AbortIfIncomplete:
    """A connection's transport whose ``close`` discards unsent data when the response in
    progress is incomplete. uvicorn closes the connection of a response that ended early
    (a client dropped for not reading, :mod:`kvroute.router.send_deadline`); a plain close
    waits to flush the buffer to a client that never reads, keeping the socket forever."""

    def __init__(self, transport: asyncio.Transport, protocol: H11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        cycle = self._protocol.cycle
        if cycle is not None and not cycle.response_complete:
            self._transport.abort()
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def uvicorn_config(
    app: Any, head_timeout_s: float = 30.0, idle_timeout_s: float = KEEP_ALIVE_S, **kw: Any
) -> Config:
    """uvicorn's config for a front door: h11 with head deadlines, keep-alive past a load
    balancer's idle timeout (a backend that closes an idle connection first races the
    balancer's next request on it), warnings only unless ``kw`` says otherwise."""
    deadlines = {"head_timeout_s": head_timeout_s, "idle_timeout_s": idle_timeout_s}
    protocol = type("FrontDoorH11Protocol", (DeadlineH11Protocol,), deadlines)
    kw.setdefault("log_level", "warning")
    kw.setdefault("timeout_keep_alive", idle_timeout_s)
    return Config(app, http=protocol, **kw)
