"""From a routed request's runs to the HTTP response: one JSON body, or SSE.

Why the shape: a request is routed before the response starts (:mod:`.intake`) and its
first token awaited here before the status goes out, so errors before it get a real status
(:func:`~.errors.status_of`); a failure after it ends the SSE stream with an ``error``
event, then ``[DONE]`` -- never a silently cut stream. A stream's response is made before
its first token and its head sent after, so making it is off the time to first token. When
the client goes away, the SSE writer is cancelled (streaming) or the handler notices
(non-streaming); closing the :class:`RequestRun` cancels the request on the replica.

Where it sits on a request's path (see :mod:`.app`): last. :mod:`.app` hands it the runs
:mod:`.intake` started, with a :class:`ResponseContext` (the tokenizer, /metrics' series,
the HTTP layer's error counts, the send deadline); it reads each run (:mod:`.request_run`),
puts an echoed prompt ahead (:mod:`.choices.echo`), and either answers with one body or
hands the stream to :mod:`.sse`, which writes it. A request's end is recorded by
:func:`~.metrics.end_request`. Several choices are :mod:`.choices.respond`' (same parts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..fleet.request_run import REPLICA_FAILURES, RequestRun
from .errors import FAILED, APIError, new_id, one_line, request_failed, status_of
from .metrics import end_request
from .openai_api import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
    make_choice,
    make_response,
    usage_of,
)
from .sse import ChunkEncoder, SSEResponse, write_stream

if TYPE_CHECKING:
    from .agents.tools import ToolPlan
    from .choices.echo import Echo
    from .metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """What answering needs of the app, made once: the tokenizer (logprobs' token names),
    /metrics' per-request series, the HTTP layer's error counts, the send deadline."""

    tokenizer: Any
    metrics: Metrics
    errors: Counter[str]
    send_timeout_s: float | None = None


REPLICA_HEADER = "x-kvroute-replica"
FLOOR = -9999.0  # the least logprob a response shows (a forbidden token's is -inf)
DISCONNECT_POLL_S = 0.5


class Logprobs:
    """The engine's logprobs (per token: ``{token id: logprob}``, the sampled token and the
    top alternatives) in OpenAI's two shapes, for one request (it keeps the text offset)."""

    def __init__(self, tokenizer: Any, top: int, names: dict[int, str] | None = None) -> None:
        """``names``: token names already decoded, shared by the choices of one request."""
        self.tokenizer = tokenizer
        self.top = top
        self.offset = 0  # characters of the completion's tokens so far (``text_offset``)
        self._names: dict[int, str] = {} if names is None else names

    def _name(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._names[token_id] = self.tokenizer.decode([token_id])
        return name

    def _entries(
        self, ids: list[int], entries: list[dict[int, float] | None] | None
    ) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
        """Per token: its id, logprob and top alternatives; an entry of None (an echoed
        prompt's first token) gives None for both."""
        out: list[tuple[int, float | None, list[tuple[int, float]] | None]] = []
        for i, tid in enumerate(ids):
            entry = entries[i] if entries is not None and i < len(entries) else {}
            if entry is None:
                out.append((tid, None, None))
                continue
            best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[: self.top]
            # The engine always reports the sampled token; -9999 (OpenAI's "very unlikely")
            # only if an entry was lost, and for a token a structured output forbade (-inf,
            # which JSON cannot carry), as vLLM's server clamps it.
            best = [(t, v if v > FLOOR else FLOOR) for t, v in best]
            lp = entry.get(tid, FLOOR)
            out.append((tid, lp if lp > FLOOR else FLOOR, best))
        return out

    def completion(
        self, ids: list[int], entries: list[dict[int, float] | None] | None
    ) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for tid, logprob, best in self._entries(ids, entries):
            name = self._name(tid)
            lp.tokens.append(name)
            lp.token_logprobs.append(logprob)
            top: dict[str, float] | None = None if best is None else {}
            for t, v in best or ():  # likeliest first: a name two tokens share keeps the higher
                top.setdefault(self._name(t), v)  # type: ignore[union-attr]
            lp.top_logprobs.append(top)
            lp.text_offset.append(self.offset)
            self.offset += len(name)
        return lp

    def chat(self, ids: list[int], entries: list[dict[int, float]] | None) -> ChatLogprobs:
        content = []
        for tid, logprob, best in self._entries(ids, entries):  # never None: no echo in chat
            name = self._name(tid)
            top = [TopLogprob(token=self._name(t), logprob=v, bytes=_bytes(self._name(t)))
                   for t, v in best or ()]  # fmt: skip
            content.append(
                ChatTokenLogprob(token=name, logprob=logprob, bytes=_bytes(name), top_logprobs=top)
            )
        return ChatLogprobs(content=content)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "replace"))


class Collected:
    """A run's answer as it arrives: text pieces, token ids, logprob entries, last delta."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.sizes: list[int] = []  # each part's number of tokens
        self.ids: list[int] = []
        self.entries: list[dict[int, float] | None] = []
        self.last: Any = None

    def text(self) -> str:
        return "".join(self.parts)

    def tool_text(self, tools: ToolPlan) -> str:
        """The text as ``tools``' parser reads it (its special-token markers put back)."""
        if not tools.markers:
            return self.text()
        out, at = [], 0
        for part, size in zip(self.parts, self.sizes, strict=True):
            out.append(tools.text_of(part, self.ids[at : at + size]))
            at += size
        return "".join(out)

    async def collect(self, run: RequestRun) -> None:
        """Every delta of ``run`` from its first (which must be in) to its last."""
        d = run.first
        while d is not None:
            self.parts.append(d.delta_text)
            self.sizes.append(len(d.delta_token_ids))
            self.ids.extend(d.delta_token_ids)
            self.entries.extend(d.logprobs or [{} for _ in d.delta_token_ids])
            self.last = d
            d = None if d.finished else await run.next()


def response_id(chat: bool) -> str:
    """The id of a request's answer (its chunks' and its body's ``id``)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{new_id()}"


async def await_first_delta(run: RequestRun, rid: str, echo: Echo | None = None) -> None:
    """Waits for the run's first delta, so that everything that can go wrong before it (a
    bad request, a dead replica) is settled while an HTTP status can still say so; every
    failure a status, the run closed. ``echo``: the prompt put ahead of it."""
    try:
        first = await run.first_delta()
        if first.finish_reason == "error":  # failed before its first token: a status
            raise request_failed(rid, first)
    except BaseException as exc:
        run.close()
        raise status_of(rid, exc) from None
    if echo is not None:
        echo.put_ahead(run)


async def first_or_gone(
    ctx: ResponseContext, request: Request, run: RequestRun, rid: str, echo: Echo | None
) -> bool:
    """:func:`await_first_delta` for an answer sent whole, watching for the client to
    leave while the run waits at the door (Starlette does not cancel the handler): False
    when it left (the run closed, out of the queue)."""
    task = asyncio.ensure_future(await_first_delta(run, rid, echo))
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                ctx.errors["client_gone"] += 1
                return False
        task.result()  # its status, when it failed
        return True
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            run.close()


async def collect_whole(
    ctx: ResponseContext,
    request: Request,
    rid: str,
    run: RequestRun,
    got: Collected,
    ttft_s: float | None,
    arrival: float | None,
) -> Response | None:
    """All of ``run`` into ``got``, for an answer sent whole (a chat's, a completion's, the
    Responses API's). Starlette does not cancel a handler whose client left: this watches
    for it, so an abandoned request stops using the replica, and gives the 499 to return
    (nobody reads it); None once all is in. A replica's failure: its end recorded, then an
    :class:`~.errors.APIError` 503. The run is closed whatever happens."""
    task = asyncio.ensure_future(got.collect(run))
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                ctx.errors["client_gone"] += 1
                return Response(status_code=499)
        await task
    except REPLICA_FAILURES as exc:
        log.warning("request %s: replica failed mid-request: %s", rid, one_line(str(exc)))
        end_request(ctx.metrics, rid, run, got.last, ttft_s, "503 replica_failed", arrival)
        raise APIError(503, FAILED, "service_unavailable", code="replica_failed") from None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        run.close()  # cancels the request on the replica if it still runs
    return None


async def respond(
    ctx: ResponseContext,
    request: Request,
    rid: str,
    body: Any,
    run: RequestRun,
    arrival: float | None = None,
    echo: Echo | None = None,
    tools: ToolPlan | None = None,
) -> Response:
    """One run's answer: one body, or an SSE stream of its chunks. ``run`` has been sent;
    its first delta is awaited here (:func:`await_first_delta`), before the status goes
    out. ``rid``: the request's id; ``arrival``: ``perf_counter()`` when the handler
    began, for the added-latency figure; ``echo``: the prompt to put ahead; ``tools``: a
    chat's tool plan (its text read as calls: :mod:`.tools`). ``body``: the request's,
    checked (:mod:`.openai_api`'s or its :mod:`.openai_wire` twin)."""
    chat = body.chat
    resp_id = response_id(chat)
    model: str = body.model
    n = body.num_logprobs()
    logprobs = None  # one shaper for the whole stream: ``text_offset`` runs on
    if n is not None:
        shapes = Logprobs(ctx.tokenizer, n)
        logprobs = shapes.chat if chat else shapes.completion
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        encoder = ChunkEncoder(chat, resp_id, int(time.time()), model)

        # A partial, not a closure: the stream's writer is sse.py's own code.
        write = partial(
            write_stream, ctx, run, rid, encoder, include_usage, chat, logprobs, arrival, tools
        )

        async def first() -> None:
            try:
                await await_first_delta(run, rid, echo)
            except asyncio.CancelledError:  # the client left before its first token
                ctx.errors["client_gone"] += 1
                end_request(ctx.metrics, rid, run, None, None, "499 client_gone", arrival)
                raise

        return SSEResponse(
            write,
            lambda: {REPLICA_HEADER: run.replica},  # where the first delta came from
            ctx.send_timeout_s,
            on_close=run.close,
            ready=first,
        )
    if run.waiting:  # at the door (flow control): a client that leaves takes it out
        if not await first_or_gone(ctx, request, run, rid, echo):
            return Response(status_code=499)
    else:
        await await_first_delta(run, rid, echo)
    headers = {REPLICA_HEADER: run.replica}
    ttft_s = None if arrival is None else time.perf_counter() - arrival  # first delta is in
    got = Collected()
    got.last = run.first
    gone = await collect_whole(ctx, request, rid, run, got, ttft_s, arrival)
    if gone is not None:
        return gone
    last = got.last
    finish = None if last is None else last.finish_reason
    if finish == "error":
        end_request(ctx.metrics, rid, run, last, ttft_s, "500 request_failed", arrival)
        raise request_failed(rid, last)
    usage = usage_of(last)
    end_request(ctx.metrics, rid, run, last, ttft_s, f"200 {finish}", arrival)
    shaped = logprobs(got.ids, got.entries) if logprobs is not None else None
    text: str | None = got.text()
    calls = None
    if tools is not None:
        text, parsed = tools.read(got.tool_text(tools))
        finish = tools.finish_reason(finish, parsed)
        calls = tools.tool_calls(parsed)
    choice = make_choice(chat, 0, text, finish, shaped, calls)
    return JSONResponse(make_response(chat, resp_id, model, [choice], usage), headers=headers)
