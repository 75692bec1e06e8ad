"""The front door's HTTP server: uvicorn, with a deadline on every request head.

Why: uvicorn arms no timer on a new connection, and cancels its keep-alive timer on the
first byte of the next request. A client that connects and never completes its request
head (slowloris: a header line every few seconds) holds its connection, socket and buffers
for as long as it likes, and enough of them exhaust the server's file descriptors. Here:

- a fresh connection that sends nothing is closed after ``idle_timeout_s``, as a kept-alive
  idle one is (the same keep-alive a load balancer relies on);
- once the first byte of a request head arrives, the whole head must arrive within
  ``head_timeout_s``, or the connection is closed;
- the body then has its own deadline in the app (a 408: :mod:`kvroute.router.api.intake`);
- a connection whose response ended incomplete is aborted, not closed: its unsent data is
  discarded rather than waited on.

With ``uvicorn[standard]`` installed the server runs httptools on uvloop: uvicorn's h11
protocol costs two to three times its CPU per streamed chunk, and the front door streams
every token. Without them, h11 on asyncio, with the same deadlines.

Its socket is bound before anything else starts (:func:`listen_socket`), as ``vllm serve``
binds its own before the engine.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from uvicorn import Config, Server
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn[standard] installs both (httptools' protocol is most of the saving per chunk)
    import uvloop  # noqa: F401
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

KEEP_ALIVE_S = 75  # past a load balancer's idle timeout (AWS ALB: 60 s), see uvicorn_config


class _Deadlines:
    """The deadlines for a uvicorn HTTP protocol (mixed in before it): an idle deadline for
    fresh connections, one for each request head (class attributes: set on a subclass, see
    :func:`uvicorn_config`). Both of uvicorn's protocols set ``cycle`` once a head is
    parsed, which is all this needs to know of them."""

    idle_timeout_s: float = KEEP_ALIVE_S
    head_timeout_s: float = 30.0
    _head_timer: asyncio.TimerHandle | None = None
    _head_started = False
    loop: asyncio.AbstractEventLoop  # the protocol's
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm(self.idle_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head() and not self._head_started:
            self._head_started = True  # the clock for this head starts at its first byte
            self._arm(self.head_timeout_s)
        super().data_received(data)  # type: ignore[misc]
        if not self._awaiting_head():  # the head is in: the app and keep-alive take over
            self._head_started = False
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

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

    def _wrap_new_cycle(self) -> None:
        """Gives the request just parsed (``cycle``) a transport that aborts an incomplete
        response: called where each protocol creates it, before its app task first runs."""
        cycle = self.cycle
        if cycle is not None and not isinstance(cycle.transport, _AbortIfIncomplete):
            cycle.transport = _AbortIfIncomplete(cycle.transport, cycle, self.loop)


class DeadlineH11Protocol(_Deadlines, H11Protocol):
    """uvicorn's h11 protocol with the deadlines: the fallback without ``uvicorn[standard]``."""

    def handle_events(self) -> None:
        super().handle_events()
        self._wrap_new_cycle()  # h11 parses one request per cycle: at most one new here


if HttpToolsProtocol is not None:

    class DeadlineHttpToolsProtocol(_Deadlines, HttpToolsProtocol):
        """uvicorn's httptools protocol with the deadlines."""

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            # Here, not after data_received: one packet may carry several pipelined heads.
            self._wrap_new_cycle()


class _AbortIfIncomplete:
    """A request's transport whose ``close`` discards unsent data when its response is
    incomplete. uvicorn closes the connection of a response that ended early (a client
    dropped for not reading, :mod:`kvroute.router.api.send_deadline`); a plain close waits to
    flush the buffer to a client that never reads, keeping the socket forever. Bound to the
    request, not the connection: with httptools a pipelined request replaces the protocol's
    ``cycle`` while the response before it is still being written (and may end in a close
    that must flush).

    It also holds the response's first write (its head) back until the next write or the
    end of the loop's current iteration, whichever comes first: the server writes the head
    and the first piece of the body in two calls, which would be two system calls and, on
    loopback, two wake-ups of the client. A streamed completion's first chunk follows its
    head in the same step (its first token is in before the response starts), so the two
    leave in one write. Order is kept; nothing is held past the iteration."""

    def __init__(
        self, transport: asyncio.Transport, cycle: Any, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._transport = transport
        self._cycle = cycle
        self._loop = loop
        self._first = True
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self._first:
            self._first = False
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._flush()
        if self._cycle.response_complete:
            self._transport.close()
        else:
            self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        # Kept once looked up (``is_closing``, ``get_extra_info``, ...): a lookup that
        # reaches __getattr__ first fails the normal way (an AttributeError each time).
        value = getattr(self._transport, name)
        setattr(self, name, value)
        return value


def uvicorn_config(
    app: Any, head_timeout_s: float = 30.0, idle_timeout_s: float = KEEP_ALIVE_S, **kw: Any
) -> Config:
    """uvicorn's config for a front door: httptools on uvloop where installed (else h11 on
    asyncio) with head deadlines, keep-alive past a load balancer's idle timeout (a backend
    that closes an idle connection first races the balancer's next request on it), warnings
    only unless ``kw`` says otherwise."""
    if HttpToolsProtocol is not None:
        base: type = DeadlineHttpToolsProtocol
        kw.setdefault("loop", "uvloop")
    else:
        base = DeadlineH11Protocol
        kw.setdefault("loop", "asyncio")
    deadlines = {"head_timeout_s": head_timeout_s, "idle_timeout_s": idle_timeout_s}
    protocol = type("FrontDoor" + base.__name__.removeprefix("Deadline"), (base,), deadlines)
    kw.setdefault("log_level", "warning")
    kw.setdefault("timeout_keep_alive", idle_timeout_s)
    return Config(app, http=protocol, **kw)


class IdleQuietServer(Server):
    """uvicorn's server, waking its loop once a second rather than ten times.

    Why: uvicorn's ``main_loop`` sleeps 0.1 s at a time to look at ``should_exit``, and
    refreshes the ``Date`` header every tenth wake-up: an idle front door's loop woke ten
    times a second for it. Here it wakes on each second's turn (the header, to the second,
    as before) and at once when a signal asks it to stop (:meth:`handle_exit`); setting
    ``should_exit`` directly is seen within the second."""

    _wake: asyncio.Future[None] | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        while not await self.on_tick(0):  # counter 0: uvicorn's tick that dates the header
            wake = self._wake = loop.create_future()
            timer = loop.call_later(1.0 - time.time() % 1.0, _settle, wake)
            try:
                await wake
            finally:
                timer.cancel()
                self._wake = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_settle, wake)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The front door's socket, bound before Ray or any model starts (as ``vllm serve``
    binds its own): a port one of Ray's processes took meanwhile would otherwise fail the
    start once the model had loaded. ``port`` 0 lets the kernel pick one (read it back with
    ``getsockname``); with ``reuse_port``, several processes share it. OSError: it cannot
    be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listen_or_say(
    host: str, port: int, reuse_port: bool, say: Callable[[str], None]
) -> socket.socket | None:
    """:func:`listen_socket`, or None once ``say`` told why it cannot be bound."""
    try:
        return listen_socket(host, port, reuse_port)
    except OSError as exc:
        why = exc.strerror or exc
        say(f"cannot listen on {host}:{port} ({why}); is another server on it? --port")
        return None
