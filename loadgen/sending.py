"""Sending: streamed ``/v1/completions`` over kept-alive HTTP/1.1 connections, timed per event.

Why not the ``openai`` client, nor httpx: the load generator shares the machine with the
fleet it measures, and what the client spends between a chunk's arrival and its timestamp
lands in every latency it reports. httpx spends milliseconds of CPU per streamed request
(httpcore's state machine, h11, anyio's cancel scopes and a decoder per chunk), which showed
up in every TTFT (BENCHMARKS.md, "Serving path"); the front door's own
client for ``vllm serve`` (:mod:`kvroute.router.backends.wire`) hands each body line to a
callback inside the protocol, so a chunk is timed when it arrives. Every failure (HTTP
status, timeout, refused connection, an ``error`` event in the stream) becomes a record
with an error kind, never an exception out of :func:`run_load`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec

from kvroute.router.api.responses import REPLICA_HEADER
from kvroute.router.backends.wire import (
    BackendPool,
    ConnectFailedError,
    Connection,
    StreamBrokenError,
)

from .sources import Planned

DEFAULT_URL = "http://127.0.0.1:8000/v1"


class Record(msgspec.Struct, kw_only=True):
    """One request as the client saw it; times in seconds, ``start_s`` from the run's start."""

    index: int
    start_s: float
    error: str | None = None  # kind: http_429, timeout, connect, stream_error, cancelled ...
    detail: str | None = None  # first line of the error, for the JSON file
    replica: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = msgspec.field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # of those, tokens a replica loaded from a lower KV tier ("CPU": host, "STORAGE": disk)
    cached_tokens_by_tier: dict[str, int] = msgspec.field(default_factory=dict)
    output_tokens: int | None = None
    cache_salt: str | None = None
    # kvroute's own figures, from its ``: kvroute-timing`` SSE comment (None elsewhere)
    replica_ttft_s: float | None = None
    router_ttft_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class StreamError(Exception):
    """The server said, inside a 200 stream, that the request failed."""


class SSEReader:
    """Cuts a response body's lines (from :mod:`kvroute.router.backends.wire`, one call per
    line, without its newline) into server-sent events: ``on_event(data)`` per event's
    ``data`` (multi-line data joined by newlines) until ``[DONE]``, comment lines to
    ``on_comment``; an ``event: error`` event raises :class:`StreamError`."""

    __slots__ = ("_data", "_kind", "done", "on_comment", "on_event")

    def __init__(
        self, on_event: Callable[[str], None], on_comment: Callable[[str], None] | None = None
    ) -> None:
        self.on_event, self.on_comment = on_event, on_comment
        self._data: list[str] = []
        self._kind: str | None = None
        self.done = False  # [DONE] seen: the rest of the body is read and ignored

    def line(self, raw: bytes) -> None:
        if self.done:
            return
        if not raw:
            self.end()
            return
        line = raw.decode("utf-8", "replace")
        if line[0] == ":":  # comment / keep-alive
            if self.on_comment is not None:
                self.on_comment(line[1:].strip())
            return
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._kind = value

    def end(self) -> None:
        """The event so far is whole (a blank line, or the body's end)."""
        data, kind = self._data, self._kind
        self._data, self._kind = [], None
        if not data:
            return
        text = "\n".join(data)
        if kind == "error":
            raise StreamError(text[:200])
        if text == "[DONE]":
            self.done = True
            return
        self.on_event(text)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:200]


def _error_message(body: str) -> str:
    """An OpenAI-style error body's ``message``, else the body's first line."""
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return _first_line(str(err["message"]))
    except (ValueError, AttributeError):
        pass
    return _first_line(body)


async def send_one(
    pool: BackendPool,
    req: Planned,
    t_run: float,
    timeout: float,
    rec: Record | None = None,
) -> Record:
    """Sends one streamed completion and times it into ``rec`` (a new one if None), which
    keeps what was measured even if the task is cancelled; any failure is its ``error``."""
    t0 = time.perf_counter()
    if rec is None:
        rec = Record(index=req.index, start_s=t0 - t_run)
    rec.start_s, rec.cache_salt = t0 - t_run, req.cache_salt
    body = _encode(req.body)
    data = pool.head("POST", "/completions", len(body), req.api_key) + body
    last: float | None = None

    def on_event(text: str) -> None:
        nonlocal last
        now = time.perf_counter()
        chunk = _decode(text)
        if "error" in chunk:
            raise StreamError(str(chunk["error"].get("message", chunk["error"])))
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") == "error":
                raise StreamError("finish_reason error")
            if choice.get("text") or choice.get("finish_reason"):
                if last is None:
                    rec.ttft_s = now - t0
                elif choice.get("text"):
                    rec.itl_s.append(now - last)
                last = now
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens") or 0
            rec.cached_tokens_by_tier = dict(details.get("cached_tokens_by_tier") or {})

    sse = SSEReader(on_event, lambda c: _timing(rec, c))
    conns: list[Connection] = []  # the one it went out on last (its headers name the replica)
    try:
        async with asyncio.timeout(timeout):
            # Given up on (timed out, cancelled), the connection is closed: the server aborts.
            conn, status, refused = await pool.send(data, sse.line, conns.append)
            rec.replica = conn.headers.get(REPLICA_HEADER)
            if status != 200:
                rec.error = f"http_{status}"
                rec.detail = _error_message(refused.decode("utf-8", "replace"))
                return rec
            sse.end()
        rec.e2e_s = time.perf_counter() - t0
        if rec.ttft_s is None:
            rec.error, rec.detail = "empty_stream", "no content chunk before the stream ended"
    except StreamError as e:
        rec.error, rec.detail = "stream_error", _first_line(str(e))
    except TimeoutError:
        rec.error = "timeout"
    except ConnectFailedError as e:
        rec.error, rec.detail = "connect", _first_line(str(e))
    except StreamBrokenError as e:
        rec.error, rec.detail = "disconnected", _first_line(str(e)) or type(e).__name__
    except (msgspec.DecodeError, ValueError, AttributeError) as e:
        rec.error, rec.detail = "bad_chunk", _first_line(str(e))
    except asyncio.CancelledError:
        rec.error = "cancelled"
        raise
    finally:
        if rec.replica is None and conns:  # failed mid-response: its head was read
            rec.replica = conns[-1].headers.get(REPLICA_HEADER)
    return rec


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def _timing(rec: Record, comment: str) -> None:
    """kvroute's ``kvroute-timing {"replica_ttft_s": .., "router_ttft_s": ..}`` comment."""
    name, _, payload = comment.partition(" ")
    if name != "kvroute-timing":
        return
    try:
        t = json.loads(payload)
        rec.replica_ttft_s = float(t["replica_ttft_s"])
        rec.router_ttft_s = float(t["router_ttft_s"])
    except (ValueError, KeyError, TypeError):
        pass  # a figure we cannot read is a figure we do not report


class Progress:
    """``completed/total, errors, elapsed`` on stderr: one line redrawn every 0.5 s on a
    terminal, a new line every 5 s into a file or pipe."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.errors = 0
        self.t0 = time.perf_counter()
        self._shown = 0.0
        self._tty = sys.stderr.isatty()

    def add(self, rec: Record) -> None:
        self.done += 1
        self.errors += not rec.ok
        self.tick(last=self.done == self.total)

    def tick(self, last: bool = False) -> None:
        """Shows the line if it is due (called on each finished request and twice a second,
        so a run waiting on slow requests still shows it is alive); ``last``: now."""
        now = time.perf_counter()
        every = 0.5 if self._tty else 5.0
        if self.enabled and (now - self._shown >= every or last):
            self._shown = now
            line = f"bench: {self.done}/{self.total} done, {self.errors} errors, "
            line += f"{now - self.t0:.1f} s"
            print("\r" + line if self._tty else line, end="" if self._tty else "\n",
                  file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        if self.enabled and self._tty:
            print(file=sys.stderr, flush=True)


class Breaker:
    """Trips after ``limit`` finished requests in a row failed (a cancelled one counts neither
    way; 0: never): a server that refuses everything is reported within seconds, not after
    the whole run. ``last`` is the latest failure, the one to show."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row = limit, 0
        self.last: Record | None = None
        self.tripped = False

    def add(self, rec: Record) -> bool:
        if rec.error == "cancelled":
            return self.tripped
        if rec.ok:
            self.in_a_row = 0
        else:
            self.in_a_row += 1
            self.last = rec
            if self.limit and self.in_a_row >= self.limit:
                self.tripped = True
        return self.tripped


def describe_failure(rec: Record) -> str:
    """``HTTP 400: <the server's message>`` (or the error kind and its detail)."""
    kind = rec.error or "ok"
    what = f"HTTP {kind[5:]}" if kind.startswith("http_") else kind
    return f"{what}: {rec.detail}" if rec.detail else what


async def fetch_card(url: str, api_key: str | None, timeout: float = 30.0) -> dict[str, Any]:
    """The first model card ``GET /v1/models`` lists (``id``; kvroute and vLLM add
    ``max_model_len``, kvroute ``vocab_size``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        r = await client.get(url + "/models", headers=headers)
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code}: {_error_message(r.text)}")
        models = r.json().get("data") or []
    if not models:
        raise ValueError(f"{url}/models lists no model")
    card = dict(models[0])
    card["id"] = str(card["id"])
    return card


async def run_load(
    url: str,
    requests: Sequence[Planned],
    *,
    concurrency: int | None = None,
    duration: float | None = None,
    grace: float = 10.0,
    timeout: float = 300.0,
    on_done: Callable[[Record], None] | None = None,
    breaker: Breaker | None = None,
    on_tick: Callable[[], None] | None = None,
) -> tuple[list[Record], float]:
    """Sends ``requests`` (at their ``at_s``, or ``concurrency`` at a time in order) and
    returns their records in index order and the wall time. After ``duration`` s nothing new
    is sent; requests still running ``grace`` s later are cancelled (``cancelled``). When
    ``breaker`` trips, nothing new is sent and requests in flight are cancelled at once.
    ``on_tick`` is called twice a second while the run lasts."""
    url = url.rstrip("/")
    records: dict[int, Record] = {}
    tasks: dict[int, asyncio.Task[Record]] = {}
    partial: dict[int, Record] = {}
    requests_by_index = {r.index: r for r in requests}
    # Kept-alive HTTP/1.1 connections, one per request in flight (no proxy from the
    # environment: loopback load must not detour).
    pool = BackendPool(url, connect_timeout_s=min(timeout, 30.0), keep_headers=(REPLICA_HEADER,))
    t_run = time.perf_counter()
    stop_at = t_run + duration if duration is not None else None
    halt = asyncio.Event()

    async def ticker() -> None:
        while on_tick is not None:
            await asyncio.sleep(0.5)
            on_tick()

    ticking = asyncio.create_task(ticker()) if on_tick is not None else None

    def finish(req: Planned, task: asyncio.Task[Record]) -> None:
        if req.index in records:
            return
        rec = partial[req.index]  # what send_one measured so far, whatever happened
        if task.cancelled():
            rec.error = "cancelled"
        elif task.exception() is not None:  # a bug here, not the server's: still a record
            rec.error, rec.detail = "client", _first_line(repr(task.exception()))
        records[req.index] = rec
        if on_done is not None:
            on_done(rec)
        if breaker is not None and breaker.add(rec):
            halt.set()

    def launch(req: Planned) -> asyncio.Task[Record]:
        rec = partial[req.index] = Record(index=req.index, start_s=time.perf_counter() - t_run)
        task = asyncio.create_task(send_one(pool, req, t_run, timeout, rec))
        task.add_done_callback(lambda t, r=req: finish(r, t))
        tasks[req.index] = task
        return task

    def time_left() -> float | None:
        return None if stop_at is None else stop_at - time.perf_counter()

    async def wait_all(aws: Sequence[asyncio.Task[Any]], timeout: float | None) -> None:
        """Until ``aws`` are all done, ``timeout`` passes or the breaker trips."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        halted = asyncio.create_task(halt.wait())
        try:
            pending = set(aws)
            while pending and not halt.is_set():
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    return
                _, pending = await asyncio.wait(
                    [*pending, halted], timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(halted)
        finally:
            halted.cancel()

    try:
        if concurrency is not None:
            queue = list(reversed(requests))

            async def worker() -> None:
                while queue and not halt.is_set():
                    left = time_left()
                    if left is not None and left <= 0:
                        return
                    await asyncio.wait([launch(queue.pop())])  # its outcome is its record

            workers = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
            await wait_all(workers, time_left())
        else:
            for req in requests:
                wait = t_run + (req.at_s or 0.0) - time.perf_counter()
                left = time_left()
                if left is not None and (left <= 0 or (wait > 0 and wait >= left)):
                    break
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(halt.wait(), wait)
                    left = time_left()
                    if left is not None and left <= 0:  # the sleep overran the deadline
                        break
                if halt.is_set():
                    break
                launch(req)
            workers = []
        running = [t for t in tasks.values() if not t.done()]
        if running and not halt.is_set():
            # Past --duration in-flight requests get a grace; otherwise all are waited for.
            await wait_all(running, grace if stop_at is not None else None)
        for t in [*tasks.values(), *workers]:
            t.cancel()
        await asyncio.gather(*tasks.values(), *workers, return_exceptions=True)
        for i, task in tasks.items():  # done callbacks ran already; this only makes sure
            finish(requests_by_index[i], task)
    finally:
        wall = time.perf_counter() - t_run
        if ticking is not None:
            ticking.cancel()
        pool.close()
    return [records[i] for i in sorted(records)], wall


def count_errors(records: Sequence[Record]) -> dict[str, int]:
    return dict(Counter(r.error for r in records if r.error is not None).most_common())


def error_examples(records: Sequence[Record]) -> dict[str, str]:
    """Per error kind, the detail of its first occurrence (what to look up first)."""
    out: dict[str, str] = {}
    for r in records:
        if r.error is not None and r.error not in out:
            out[r.error] = r.detail or ""
    return out
