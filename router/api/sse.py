"""Server-sent events for a streamed completion: chunks encoded once, sent on a short path.

Why its own module: per streamed token this is most of what a front door does, and the
general tools cost more than the work. A chunk is the same JSON every time except for its
text, logprobs and finish reason, so :class:`ChunkEncoder` renders the constant head and
tail once per request and splices the rest in with msgspec (no pydantic model and no
``json.dumps`` per token). :class:`SSEResponse` sends the response head through the app's
middleware (request id, status counters) and the body chunks on the server's own ``send``,
which the app keeps in the scope (``RAW_SEND``): a chunk does not pass through every
middleware's wrapper; from the app's own endpoints the head goes there too. A completion's
stream is written here (:func:`write_stream`), so a chunk is encoded and sent without a
call back into the module that asked for it. The deadline on a client that stops reading
(:mod:`.send_deadline`) is kept here with two timestamps per send instead of a timer, read
by one sweeper task per event loop; a disconnect is watched by one task per stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvroute.events.replica_api import GenerateDelta

from .agents.tools import ToolStream
from .errors import request_failed, stream_failure
from .metrics import end_request
from .openai_api import error_body, usage_of
from .send_deadline import ClientTooSlowError

if TYPE_CHECKING:
    from ..fleet.request_run import RequestRun
    from .agents.tools import ToolPlan
    from .responses import ResponseContext

log = logging.getLogger(__name__)

RAW_SEND = "kvroute.raw_send"
_json = msgspec.json.Encoder()
encode_json = _json.encode
DONE = b"data: [DONE]\n\n"
SWEEP_INTERVAL_S = 1.0  # how late past its deadline a stuck send may be cancelled


class Emit(Protocol):
    """Sends one chunk of the body; ``last``: and ends the body in the same write."""

    def __call__(self, chunk: bytes, last: bool = False) -> Awaitable[None]: ...

    def now(self, chunk: bytes) -> bool:
        """Writes one chunk at once, without awaiting (from a callback), when the client
        keeps up; False when it cannot (the socket's buffer is full, a send waits, the
        client left, or the server is not one it can write to): then ``await emit(chunk)``."""
        ...


class ChunkEncoder:
    """``data: {...}\\n\\n`` lines of one request's stream, in OpenAI's shapes."""

    __slots__ = ("_chat", "_head", "_usage_head")

    def __init__(
        self, chat: bool, response_id: str, created: int, model: str, index: int = 0
    ) -> None:
        """``index``: the choice the chunks are of (several stream side by side)."""
        self._chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = _json.encode({"id": response_id, "object": obj, "created": created, "model": model})[
            :-1
        ]
        self._head = b"data: " + head + b',"choices":[{"index":%d,' % index
        self._usage_head = b"data: " + head + b',"choices":[],"usage":'

    def chunk(
        self, text: str, finish: str | None, logprobs: Any = None, role: bool = False
    ) -> bytes:
        """One chunk; ``logprobs`` a pydantic model (rare) or None; ``role`` for a chat's
        first chunk (``{"role": "assistant"}``)."""
        lp = b"null" if logprobs is None else _json.encode(logprobs.model_dump())
        fin = b"null" if finish is None else _json.encode(finish)
        if self._chat:
            role_part = b'"assistant"' if role else b"null"
            content = _json.encode(text) if text else b"null"
            body = b'"delta":{"role":' + role_part + b',"content":' + content + b"}"
        else:
            body = b'"text":' + _json.encode(text)
        return (
            self._head + body + b',"logprobs":' + lp + b',"finish_reason":' + fin
            + b'}],"usage":null}\n\n'
        )  # fmt: skip

    def deltas(
        self, deltas: list[dict[str, Any]], finish: str | None, logprobs: Any = None
    ) -> bytes:
        """A chat's chunks for ``deltas`` (OpenAI's ``delta`` objects: content or
        ``tool_calls`` pieces), ``logprobs`` on the first and ``finish`` on the last; one
        empty delta if there is a finish or logprobs but no delta; b"" if nothing at all."""
        if not deltas:
            if finish is None and logprobs is None:
                return b""
            deltas = [{}]
        fin = b"null" if finish is None else _json.encode(finish)
        lp = b"null" if logprobs is None else _json.encode(logprobs.model_dump())
        last = len(deltas) - 1
        return b"".join(
            self._head + b'"delta":' + _json.encode(d)
            + b',"logprobs":' + (lp if i == 0 else b"null")
            + b',"finish_reason":' + (fin if i == last else b"null")
            + b'}],"usage":null}\n\n'
            for i, d in enumerate(deltas)
        )  # fmt: skip

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return self._usage_head + _json.encode(usage) + b"}\n\n"


def data_line(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class SSEResponse(Response):
    """An ASGI response whose body ``write(emit)`` produces: it awaits ``emit(chunk)`` per
    chunk (a coroutine, not an async generator: one layer less per token), and
    ``emit(chunk, last=True)`` for the last, which then ends the body in the same write
    (else an empty last message ends it: one more write per request). The head goes
    through the app's middleware (or raw: ``head_extra``); the chunks go on the server's
    raw ``send``. The writer is
    cancelled when the client disconnects, or when one send waits longer than
    ``send_timeout_s`` (:class:`ClientTooSlowError`); ``on_close`` runs however it ends
    (the request ends on its replica, its slot is released). ``ready``, when given, is
    awaited before the head, with the disconnect watch already on: what it raises (a
    status for the app to send) leaves with nothing sent; ``headers`` may be a function,
    read after it."""

    def __init__(
        self,
        write: Callable[[Emit], Awaitable[None]],
        headers: dict[str, str] | Callable[[], dict[str, str]],
        send_timeout_s: float | None = None,
        on_close: Callable[[], None] | None = None,
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.write = write
        self.on_close = on_close
        self.ready = ready
        self.headers_of = headers if callable(headers) else lambda: headers
        self.send_timeout_s = send_timeout_s
        # Set by the app's own endpoints (app.py): the head then goes on the raw send too,
        # with these headers, and ``on_head(status)`` counts it (nothing calls back into
        # the app); else through the app's middleware, which does both.
        self.head_extra: list[tuple[bytes, bytes]] | None = None
        self.on_head: Callable[[int], None] | None = None
        self.head_sent = False
        self._sending_since = 0.0  # loop time the send in progress began; 0: none
        self._disconnected = False
        self._ended = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        watch = loop.create_task(_until_disconnect(receive))
        watch.add_done_callback(lambda w: self._on_disconnect(w, task))
        raw: Send = scope.get(RAW_SEND, send)
        body = _Body(self, raw, loop)
        sweeper = _Sweeper.of(loop) if self.send_timeout_s else None

        try:
            if sweeper is not None:
                sweeper.watch(self, task)
            if self.ready is not None:  # may raise a status: nothing is sent yet
                await self.ready()
            headers = [(k.encode(), v.encode()) for k, v in self.headers_of().items()]
            headers += _SSE_HEADERS
            head = {"type": "http.response.start", "status": 200, "headers": headers}
            if self.head_extra is None:
                await send(head)
            else:
                headers += self.head_extra
                if self.on_head is not None:
                    self.on_head(200)
                self._sending_since = loop.time()  # the send deadline holds for it too
                await raw(head)
                self._sending_since = 0.0
            self.head_sent = True
            await self.write(body)
            if body.more:  # the writer did not end the body
                await raw({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if task.cancelling() and self._disconnected:  # our own cancel: the client left
                task.uncancel()
                return
            if task.cancelling() and self._sending_since:
                task.uncancel()
                raise ClientTooSlowError from None
            raise
        finally:
            self._ended = True  # a disconnect noticed from now on cancels nothing: the
            watch.cancel()  # task may be sending the status a raising ``ready`` asked for
            if sweeper is not None:
                sweeper.forget(self)
            if self.on_close is not None:
                self.on_close()

    def _on_disconnect(self, watch: asyncio.Task[None], task: asyncio.Task[Any]) -> None:
        """The client left (or its ``receive`` broke, which ends the stream the same way)."""
        if watch.cancelled():
            return
        watch.exception()  # retrieved: a broken receive is no error of the loop's
        if self._ended:
            return
        if not task.done():
            self._disconnected = True
            task.cancel()

    def _overstayed(self, now: float) -> bool:
        since = self._sending_since
        return bool(self.send_timeout_s and since and now - since > self.send_timeout_s)


class _Body:
    """An SSE response's body, two ways out (:class:`Emit`): awaited through the server's
    ``send`` (flow control, the send deadline), or, for a chunk a callback has in hand
    while the client keeps up, written at once in HTTP/1.1's chunked framing onto
    uvicorn's httptools cycle -- the same bytes its ``send`` would write, without the
    awaits around them. Only that cycle is written to directly: it is ``raw``'s owner and
    its state (``chunked_encoding``, ``flow``, ``disconnected``) says when it may be."""

    __slots__ = ("_cycle", "_loop", "_msg", "_raw", "_response", "more")

    def __init__(self, response: SSEResponse, raw: Send, loop: asyncio.AbstractEventLoop):
        self._response = response
        self._raw = raw
        self._loop = loop
        self._msg: dict[str, Any] = {"type": "http.response.body", "body": b"", "more_body": True}
        cycle = getattr(raw, "__self__", None)
        direct = hasattr(cycle, "chunked_encoding") and hasattr(cycle, "flow")
        self._cycle = cycle if direct else None
        self.more = True

    async def __call__(self, chunk: bytes, last: bool = False) -> None:
        msg, response = self._msg, self._response
        msg["body"] = chunk
        if last:
            msg["more_body"] = self.more = False
        response._sending_since = self._loop.time()
        await self._raw(msg)
        response._sending_since = 0.0

    def now(self, chunk: bytes) -> bool:
        cycle = self._cycle
        if (
            cycle is None
            or self._response._sending_since  # a send waits: order, and its deadline
            or self._response._disconnected
            or cycle.chunked_encoding is not True
            or cycle.flow.write_paused
            or cycle.disconnected
            or cycle.response_complete
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True


class _Sweeper:
    """One task per event loop that cancels every stream whose send in progress has waited
    past its deadline, checked once a second: a timer per stream (or per send) would cost
    every request what almost none of them needs."""

    _by_loop: dict[asyncio.AbstractEventLoop, _Sweeper] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.streams: dict[SSEResponse, asyncio.Task[Any]] = {}
        self.task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Sweeper:
        sweeper = cls._by_loop.get(loop)
        if sweeper is None:
            for old in [lp for lp in cls._by_loop if lp.is_closed()]:
                del cls._by_loop[old]
            sweeper = cls._by_loop[loop] = cls(loop)
        return sweeper

    def watch(self, response: SSEResponse, task: asyncio.Task[Any]) -> None:
        self.streams[response] = task
        if self.task is None:
            self.task = self.loop.create_task(self._run(), name="kvroute-send-deadlines")

    def forget(self, response: SSEResponse) -> None:
        self.streams.pop(response, None)

    async def _run(self) -> None:
        try:
            while self.streams:  # it ends with the last stream; the next one restarts it
                await asyncio.sleep(SWEEP_INTERVAL_S)
                now = self.loop.time()
                for response, task in list(self.streams.items()):
                    if response._overstayed(now) and not task.done():
                        self.streams.pop(response, None)
                        task.cancel()
        finally:
            self.task = None


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def chunker(
    encoder: ChunkEncoder,
    logprobs: Callable[[list[int], list[dict[int, float]] | None], Any] | None,
    tools: ToolPlan | None,
) -> Callable[..., bytes]:
    """One choice's ``chunk(delta, finish=None)``: its SSE bytes (b"" when a tool plan
    holds everything back for now)."""
    shapes = None if tools is None else ToolStream(tools)

    def chunk(d: GenerateDelta, finish: str | None = None) -> bytes:
        shaped = None
        if logprobs is not None and d.delta_token_ids:
            shaped = logprobs(list(d.delta_token_ids), d.logprobs)
        if shapes is None:
            return encoder.chunk(d.delta_text, finish, shaped)
        deltas = shapes.feed(d.delta_text, d.delta_token_ids)
        if finish is not None:
            more, finish = shapes.finish(finish)
            deltas += more
        return encoder.deltas(deltas, finish, shaped)

    return chunk


async def write_stream(
    ctx: ResponseContext,
    run: RequestRun,
    rid: str,
    encoder: ChunkEncoder,
    include_usage: bool,
    role_first: bool,
    logprobs: Callable[[list[int], list[dict[int, float]] | None], Any] | None,
    arrival: float | None,
    tools: ToolPlan | None,
    emit: Emit,
) -> None:
    """``data: {json}\\n\\n`` per delta, ``data: [DONE]`` last, whatever happens.
    ``tools``: a chat's tool plan; its text is then sent as :class:`~.agents.tools.ToolStream`
    shapes it (content held back where a call may begin, calls as ``tool_calls``).

    Before ``[DONE]``, an SSE comment (clients ignore it) gives the replica's own TTFT and
    the front door's: ``: kvroute-timing {"replica_ttft_s": ..., "router_ttft_s": ...}``,
    so a load generator can tell the router's added latency from the replica's."""
    last = None
    timing: dict[str, float] | None = None
    status = "200"
    tail: list[bytes] = []  # sent after the loop with [DONE]: the end costs one write

    chunk = chunker(encoder, logprobs, tools)

    def push(d: GenerateDelta) -> bool:
        """A delta between the first and the last, as the loop below writes it, straight
        from the replica connection's callback (see :meth:`RequestRun.stream_to`). Only
        while the loop waits in ``run.next()``: never before the first chunk is out."""
        if not (d.delta_token_ids or d.delta_text):
            return True
        data = chunk(d)
        return emit.now(data) if data else True  # an empty write would end the body

    try:
        if role_first:
            await emit(encoder.chunk("", None, role=True))
        d = run.first
        if d is not None and arrival is not None and d.replica_ttft_s is not None:
            timing = ctx.metrics.time_first_delta(time.perf_counter() - arrival, d.replica_ttft_s)
        run.stream_to(push)
        while d is not None:
            last = d
            if d.finish_reason == "error":
                status = "500 request_failed (in stream)"
                err = request_failed(rid, d)
                await emit(
                    data_line(error_body(err.message, err.type, 500, code=err.code, request_id=rid))
                )
                break
            if d.finished:  # the last chunk leaves with the tail, in one write
                tail.append(chunk(d, d.finish_reason))
                break
            if d.delta_token_ids or d.delta_text:  # as vLLM: a token that completes no
                # character yet still gets its (empty) chunk, so the first one is never late
                data = chunk(d)
                if data:
                    await emit(data)
            d = await run.next()
        if last is not None and last.finished and last.finish_reason != "error":
            usage = usage_of(last)
            if include_usage and usage is not None:
                tail.append(encoder.usage(usage.model_dump()))
    except Exception as exc:  # never a silently cut stream: say so, then [DONE]
        failure = stream_failure(ctx, rid, exc)
        status = failure.status
        await emit(data_line(failure.body(rid)))
    finally:
        run.close()
        ttft = None if timing is None else timing["router_ttft_s"]
        if status == "200":  # no [DONE] reached the client: it went away mid-stream
            status = f"200 {last.finish_reason}" if last and last.finished else "499 client_gone"
        end_request(ctx.metrics, rid, run, last, ttft, status, arrival)
    if timing is not None:
        tail.append(b": kvroute-timing " + encode_json(timing) + b"\n\n")
    tail.append(DONE)
    await emit(b"".join(tail), True)
