"""A lean HTTP/1.1 client for streaming completions from one ``vllm serve``: a pool of
kept-alive connections whose response bodies are cut into lines inside the protocol.

Why not httpx: per streamed chunk httpx runs httpcore's connection state machine, h11's
chunked reader, anyio's cancel scopes and a text and a line decoder, each a coroutine or
generator step: most of the front door's CPU per request in front of ``vllm serve``
(BENCHMARKS.md, "Fronting vllm serve"). Here a chunk costs one ``data_received`` call: the
chunked framing and the SSE lines are cut from a buffer, and each line goes straight to
the caller's ``on_line`` (no task wake-up per chunk). What it implements is what vLLM's
server (uvicorn) answers: a head, then a body framed by ``transfer-encoding: chunked``,
``content-length`` or the connection's end; no redirects, no cookies, no proxies.

Failures, as the data plane needs them told apart:
- :class:`ConnectFailedError`: the request never reached the backend (refused, unreachable,
  no answer to the connect within ``connect_timeout_s``);
- :class:`StreamBrokenError`: the connection ended, or sent what is not HTTP, before the
  response was whole. A kept-alive connection the server closed as the request went out
  (``got_bytes`` False on a reused connection) is the caller's to retry once.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 << 10
_HEAD, _SIZE, _DATA, _CRLF, _TRAILER, _LENGTH, _EOF, _IDLE = range(8)

# Called with each line of a 200 response's body (without its "\n"); False stops the
# response there (the connection is closed). None in its place: the body is kept whole.
OnLine = Callable[[bytes], "bool | None"]


class ConnectFailedError(ConnectionError):
    """The backend could not be reached: nothing was sent."""


class StreamBrokenError(ConnectionError):
    """The connection ended (or spoke no HTTP) before the response was whole."""


class Connection(asyncio.Protocol):
    """One connection; one request at a time (HTTP/1.1, no pipelining)."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.uses = 0
        self.got_bytes = False
        self._state = _IDLE
        self._buf = bytearray()
        self._lines = bytearray()
        self._body = bytearray()
        self._left = 0
        self._status = 0
        self._keep_alive = True
        self.headers: dict[str, str] = {}  # the response's headers the pool keeps
        self._on_line: OnLine | None = None
        self._done: asyncio.Future[tuple[int, bytes]] | None = None

    # -- the caller's side -----------------------------------------------------------------
    def request(self, data: bytes, on_line: OnLine | None) -> asyncio.Future[tuple[int, bytes]]:
        """Sends one request; the future is (status, body) once the response is whole
        (the body only when the status is not 200 or ``on_line`` is None: a 200's body
        went to ``on_line``)."""
        assert self.transport is not None and self._state == _IDLE
        self.uses += 1
        self.got_bytes = False
        self._state = _HEAD
        self._on_line = on_line
        self._status = 0
        self._keep_alive = True
        if self.headers:
            self.headers = {}
        self._body.clear()
        self._lines.clear()
        self._done = self.pool.loop.create_future()
        self.transport.write(data)
        return self._done

    @property
    def idle(self) -> bool:
        return self._state == _IDLE and not self.closed

    def abort(self) -> None:
        """Ends the connection at once (a stream the caller gave up on: its response, if
        not whole yet, is cancelled)."""
        self.closed = True
        self._state = _IDLE
        done, self._done = self._done, None
        if done is not None and not done.done():
            done.cancel()
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio's side --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self._state == _EOF:  # a body framed by the connection's end: whole now
            self._flush_lines()
            self._finish()
        elif self._state != _IDLE:
            why = f"connection closed mid-response ({exc or 'EOF'})"
            self._fail(StreamBrokenError(why))
        self._state = _IDLE

    def data_received(self, data: bytes) -> None:
        if self._state == _IDLE:  # nothing asked: a server that talks out of turn
            self.abort()
            return
        self.got_bytes = True
        self._buf += data
        try:
            self._parse()
        except StreamBrokenError as exc:
            self._fail(exc)
            self.abort()
        except Exception as exc:  # the caller's on_line failed: its error, not the backend's
            self._fail(exc)
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost settles the response

    # -- parsing -----------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._buf
        while buf and self._state != _IDLE:
            state = self._state
            if state in (_DATA, _LENGTH):
                n = min(len(buf), self._left)
                self._left -= n
                part = bytes(buf[:n])
                del buf[:n]
                if not self._payload(part):
                    return
                if self._left == 0:
                    if state == _DATA:
                        self._state = _CRLF
                    else:
                        self._flush_lines()
                        self._finish()
            elif state in (_SIZE, _TRAILER, _CRLF):
                i = buf.find(b"\r\n")
                if i < 0:
                    if len(buf) > 4096:
                        raise StreamBrokenError("a chunk-size line past 4 kB")
                    return
                line = bytes(buf[:i])
                del buf[: i + 2]
                if state == _CRLF:
                    if line:
                        raise StreamBrokenError("a chunk not followed by CRLF")
                    self._state = _SIZE
                elif state == _SIZE:
                    try:
                        size = int(line.split(b";", 1)[0], 16)
                    except ValueError:
                        raise StreamBrokenError(f"bad chunk size {line[:40]!r}") from None
                    if size == 0:
                        self._state = _TRAILER
                    else:
                        self._left, self._state = size, _DATA
                elif not line:  # the blank line after the last chunk (trailers skipped)
                    self._flush_lines()
                    self._finish()
            elif state == _EOF:
                part = bytes(buf)
                buf.clear()
                if not self._payload(part):
                    return
            else:  # _HEAD
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise StreamBrokenError("a response head past 64 kB")
                    return
                head = bytes(buf[:i]).decode("latin-1")
                del buf[: i + 4]
                self._head(head)

    def _head(self, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise StreamBrokenError(f"not an HTTP response: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:  # 100 Continue and the like: the real head follows
            return
        self._status = status
        chunked, length = False, None
        self._keep_alive = parts[0] != "HTTP/1.0"
        keep = self.pool.keep_headers
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name in keep:
                self.headers[name] = value.strip()
            if name == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif name == "content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    raise StreamBrokenError("a bad content-length") from None
            elif name == "connection":
                v = value.strip().lower()
                self._keep_alive = v != "close" and (self._keep_alive or v == "keep-alive")
        if chunked:
            self._state = _SIZE
        elif length is not None:
            self._left, self._state = length, _LENGTH
            if length == 0:
                self._finish()
        else:
            self._keep_alive = False
            self._state = _EOF

    def _payload(self, data: bytes) -> bool:
        """Body bytes: lines to ``on_line`` (a 200), else kept. False: the caller stopped."""
        if self._status != 200 or self._on_line is None:
            self._body += data
            return True
        lines = self._lines
        lines += data
        on_line = self._on_line
        assert on_line is not None
        start = 0
        while True:
            j = lines.find(b"\n", start)
            if j < 0:
                break
            line = bytes(lines[start:j])
            start = j + 1
            if on_line(line.rstrip(b"\r")) is False:
                self._stop()
                return False
        if start:
            del lines[:start]
        return True

    def _flush_lines(self) -> None:
        if self._lines and self._status == 200 and self._on_line is not None:
            last = bytes(self._lines).rstrip(b"\r")
            self._lines.clear()
            if self._on_line(last) is False:
                self._stop()

    def _stop(self) -> None:
        """The caller has what it wants (or will have no more): settle, close."""
        self._finish(reuse=False)
        self.abort()

    def _finish(self, reuse: bool = True) -> None:
        done, self._done = self._done, None
        self._state = _IDLE
        self._on_line = None
        if done is not None and not done.done():
            done.set_result((self._status, bytes(self._body)))
        if reuse and self._keep_alive and not self.closed and not self._buf:
            self.pool._release(self)
        elif not self.closed:
            self.abort()

    def _fail(self, exc: BaseException) -> None:
        done, self._done = self._done, None
        self._state = _IDLE
        self._on_line = None
        if done is not None and not done.done():
            done.set_exception(exc)


class BackendPool:
    """Kept-alive connections to one backend (``http://`` or ``https://`` base URL); used
    from one event loop only. Connections are made on demand, one per request in flight;
    an idle one is reused, the newest first (the server closes long-idle ones)."""

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float = 5.0,
        max_idle: int = 256,
        keep_headers: tuple[str, ...] = (),
    ) -> None:
        """``keep_headers``: lower-case names of response headers to keep in each
        connection's ``headers`` (the rest are read for framing only)."""
        parts = urlsplit(base_url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.base_path = parts.path.rstrip("/")
        self.host_header = parts.netloc
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.keep_headers = frozenset(keep_headers)
        self.loop = asyncio.get_running_loop()
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self.tls else None
        self.connects = 0  # connections made (a figure for tests and benchmarks)

    def head(self, method: str, path: str, content_length: int, bearer: str | None = None) -> bytes:
        """A request head for a JSON body of ``content_length`` bytes (``bearer``: an API
        key, sent as ``Authorization: Bearer``)."""
        auth = f"authorization: Bearer {bearer}\r\n" if bearer else ""
        return (
            f"{method} {self.base_path}{path} HTTP/1.1\r\nhost: {self.host_header}\r\n"
            f"content-type: application/json\r\naccept: text/event-stream\r\n{auth}"
            f"content-length: {content_length}\r\n\r\n"
        ).encode("latin-1")

    async def acquire(self) -> Connection:
        """An idle connection, or a new one (:class:`ConnectFailedError` if none can be made)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.idle:
                return conn
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await self.loop.create_connection(
                    lambda: Connection(self),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self.tls else None,
                )
        except (OSError, TimeoutError) as exc:
            raise ConnectFailedError(f"{type(exc).__name__}: {exc}") from None
        self.connects += 1
        conn = proto  # type: ignore[assignment]
        assert isinstance(conn, Connection)
        self._all.add(conn)
        return conn

    async def send(
        self,
        data: bytes,
        on_line: OnLine | None,
        on_conn: Callable[[Connection], None] | None = None,
    ) -> tuple[Connection, int, bytes]:
        """Sends one request (head and body in ``data``) and waits for the whole response:
        (its connection, status, body; see :meth:`Connection.request`: ``on_line`` None keeps
        a 200's body too). ``on_conn`` is told each connection as the request goes out on
        it. A kept-alive connection that the server closed as the request went out (nothing
        of it answered) is retried once on a fresh one. Given up on (cancelled, or the
        caller's ``on_line`` failed), the connection is closed, so the server sees the client
        go. Raises :class:`ConnectFailedError` or
        :class:`StreamBrokenError` as the failures are told apart above."""
        for attempt in (0, 1):
            conn = await self.acquire()
            reused = conn.uses > 0
            if on_conn is not None:
                on_conn(conn)
            pending = conn.request(data, on_line)
            try:
                status, body = await pending
            except StreamBrokenError:
                if reused and not conn.got_bytes and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
            return conn, status, body
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _release(self, conn: Connection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.abort()

    def _forget(self, conn: Connection) -> None:
        self._all.discard(conn)

    def close(self) -> None:
        """Ends every connection, idle or streaming (their responses fail)."""
        self._idle.clear()
        for conn in list(self._all):
            if conn._state != _IDLE:
                conn._fail(StreamBrokenError("the pool was closed"))
            conn.abort()
        self._all.clear()
