"""The front door's HTTP server on each protocol it may run (httptools on uvloop where
``uvicorn[standard]`` is installed, h11 on asyncio otherwise): a fresh connection that sends
nothing and a request head that trickles in are closed at their deadlines, an incomplete
response's connection is aborted (a client that never reads keeps no socket), and a
complete one is flushed even with a pipelined request behind it.

Why a bare ASGI app: the deadlines live in the protocol, under any app; tests/router/
test_edge.py covers them under the real front door, on whichever protocol is installed.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from kvroute.deploy import http_server
from kvroute.deploy.http_server import uvicorn_config

from ..waiting import wait_for

HEAD_TIMEOUT = 0.5
IDLE_TIMEOUT = 3.0  # well past the head's: a slow head must not wait for it
BIG = 4 << 20  # past the socket buffers of a client that reads nothing
CUT = threading.Event()  # /cut was served


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/big: BIG bytes, and the connection closed; /cut: BIG bytes of a response that never
    completes; else "ok"."""
    path = scope["path"]
    body = b"x" * BIG if path in ("/big", "/cut") else b"ok"
    headers = [] if path == "/cut" else [(b"content-length", b"%d" % len(body))]
    if path == "/big":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": path == "/cut"})
    if path == "/cut":
        CUT.set()


PROTOCOLS = ["h11"] + (["httptools"] if http_server.HttpToolsProtocol is not None else [])


@contextlib.contextmanager
def serve(protocol: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, uvicorn.Server]]:
    if protocol == "h11":  # as without uvicorn[standard]
        monkeypatch.setattr(http_server, "HttpToolsProtocol", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn_config(
        app, HEAD_TIMEOUT, IDLE_TIMEOUT, host="127.0.0.1", port=port, lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn started")
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(10)


def connect(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def read_all(sock: socket.socket) -> bytes:
    out = b""
    with contextlib.suppress(ConnectionResetError):  # an abort: unsent data dropped
        while data := sock.recv(1 << 16):
            out += data
    return out


def test_the_fast_protocol_is_picked_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    config = uvicorn_config(app)
    if http_server.HttpToolsProtocol is not None:
        assert issubclass(config.http, http_server.DeadlineHttpToolsProtocol)
        assert config.loop == "uvloop"
    else:
        assert issubclass(config.http, http_server.DeadlineH11Protocol)
        assert config.loop == "asyncio"
    assert (config.http.head_timeout_s, config.timeout_keep_alive) == (30.0, 75)
    monkeypatch.setattr(http_server, "HttpToolsProtocol", None)
    fallback = uvicorn_config(app, 2.0, 5.0)
    assert issubclass(fallback.http, http_server.DeadlineH11Protocol)
    assert fallback.loop == "asyncio"
    assert (fallback.http.head_timeout_s, fallback.http.idle_timeout_s) == (2.0, 5.0)
    print(f"\nfront door protocol: {config.http.__mro__[1].__name__} on {config.loop}")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_idle_connections_and_slow_heads_are_closed_at_their_deadlines(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve(protocol, monkeypatch) as (port, _):
        idle, slow, kept = connect(port), connect(port), connect(port)
        t0 = time.perf_counter()
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and the rest of its head never
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while not reply.endswith(b"\r\n\r\nok"):  # h11 writes the head and body apart
            data = kept.recv(4096)
            assert data, reply
            reply += data
        closed = {}
        for name, sock in (("slow", slow), ("idle", idle), ("kept", kept)):
            assert read_all(sock) == b""
            closed[name] = time.perf_counter() - t0
            sock.close()
    assert HEAD_TIMEOUT * 0.8 < closed["slow"] < HEAD_TIMEOUT + 1.5, closed
    # A fresh connection and a kept-alive one alike: closed after IDLE_TIMEOUT of nothing.
    assert IDLE_TIMEOUT * 0.8 < closed["idle"] < IDLE_TIMEOUT + 2, closed
    assert IDLE_TIMEOUT * 0.8 < closed["kept"] < IDLE_TIMEOUT + 2, closed


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_incomplete_response_is_aborted_a_complete_one_flushed(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve(protocol, monkeypatch) as (port, server):
        # /cut ends incomplete: its connection is let go of though the client reads nothing.
        cut = connect(port)
        CUT.clear()
        cut.sendall(b"GET /cut HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(CUT.is_set, 10, "/cut served")
        wait_for(lambda: not server.server_state.connections, 10, "the connection aborted")
        assert len(read_all(cut)) < BIG
        cut.close()
        # /big completes, then closes (the app asked to): all of it arrives, though a
        # request pipelined behind it was parsed before the client read anything (httptools
        # then holds that request's cycle, incomplete, as its ``cycle``).
        big = connect(port)
        big.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # What is under test: the client reads nothing for a while (BIG fills the socket
        # buffers, so the server cannot finish; no state of its own says it has tried).
        time.sleep(0.5)
        head, _, body = read_all(big).partition(b"\r\n\r\n")
        big.close()
    assert head.startswith(b"HTTP/1.1 200") and len(body) == BIG, (head, len(body))
