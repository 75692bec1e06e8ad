"""Several choices streamed: ``n`` > 1 (or a batch of prompts) with ``stream: true``.

Why a writer of its own: each choice is a run of its own (its own route and replica, as in
:mod:`.respond`), and OpenAI streams them interleaved, each chunk naming its choice by
``index``, in whatever order their tokens come. One task per run feeds a queue; the writer
sends what is in it as it arrives (several deltas in one write when they queue up), each
choice's last chunk with its own ``finish_reason``, then the usage (each prompt counted
once, every choice's output) and ``[DONE]``. Every run's first delta is awaited before the
status goes out, so a failure before any token is a real status; a failure after it ends
the stream with an ``error`` event and ``[DONE]``, and every run is closed.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from kvroute.events.replica_api import GenerateDelta

from ...fleet.request_run import RequestRun
from ..errors import request_failed, stream_failure
from ..metrics import end_request
from ..openai_api import error_body
from ..responses import (
    REPLICA_HEADER,
    Logprobs,
    ResponseContext,
    await_first_delta,
    response_id,
)
from ..sse import DONE, ChunkEncoder, Emit, SSEResponse, chunker, data_line
from .respond import cancel_all, choices_usage

if TYPE_CHECKING:
    from ..agents.tools import ToolPlan
    from .echo import Echo


def stream_choices(
    ctx: ResponseContext,
    request: Request,
    rid: str,
    body: Any,
    runs: list[RequestRun],
    arrival: float | None = None,
    echo: Echo | None = None,
    tools: ToolPlan | None = None,
) -> Response:
    """The runs' answers as one SSE stream, a choice per run in order (``n`` runs per
    prompt, prompt by prompt: :func:`~.respond.respond_choices`' indexing)."""
    chat, n = body.chat, body.n or 1  # best_of above n is never streamed (intake)
    resp_id, created = response_id(chat), int(time.time())
    top = body.num_logprobs()
    names: dict[int, str] = {}  # token names, decoded once for all the choices
    chunks = []
    for i in range(len(runs)):
        encoder = ChunkEncoder(chat, resp_id, created, body.model, index=i)
        shapes = None if top is None else Logprobs(ctx.tokenizer, top, names)
        logprobs = None if shapes is None else (shapes.chat if chat else shapes.completion)
        chunks.append((encoder, chunker(encoder, logprobs, tools)))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    first_at: list[float | None] = [None]

    async def ready() -> None:
        try:
            await asyncio.gather(*(await_first_delta(run, rid, echo) for run in runs))
        except asyncio.CancelledError:  # the client left before its first token
            ctx.errors["client_gone"] += 1
            for run in runs:
                end_request(ctx.metrics, rid, run, None, None, "499 client_gone", arrival)
            raise
        first_at[0] = time.perf_counter()

    async def write(emit: Emit) -> None:
        ttft = None if arrival is None or first_at[0] is None else first_at[0] - arrival
        await _write(ctx, runs, rid, chat, n, chunks, include_usage, ttft, arrival, emit)

    def close() -> None:
        for run in runs:
            run.close()

    def headers() -> dict[str, str]:
        return {REPLICA_HEADER: ",".join(dict.fromkeys(str(run.replica) for run in runs))}

    return SSEResponse(write, headers, ctx.send_timeout_s, on_close=close, ready=ready)


async def _write(
    ctx: ResponseContext,
    runs: list[RequestRun],
    rid: str,
    chat: bool,
    n: int,
    chunks: list[tuple[ChunkEncoder, Any]],
    include_usage: bool,
    ttft_s: float | None,
    arrival: float | None,
    emit: Emit,
) -> None:
    queue: asyncio.Queue[tuple[int, GenerateDelta | BaseException]] = asyncio.Queue()

    async def pump(i: int, run: RequestRun) -> None:
        try:
            d = run.first
            while d is not None:
                queue.put_nowait((i, d))
                d = None if d.finished else await run.next()
        except BaseException as exc:  # handed to the writer, which says so in the stream
            queue.put_nowait((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    lasts: list[Any] = [None] * len(runs)
    status = "200"
    tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
    try:
        if chat:  # each choice's role first, as OpenAI sends it
            await emit(b"".join(enc.chunk("", None, role=True) for enc, _ in chunks))
        left = len(runs)
        while left:
            got = [await queue.get()]
            while not queue.empty():
                got.append(queue.get_nowait())
            out: list[bytes] = []
            for i, d in got:
                if isinstance(d, BaseException):
                    raise d
                lasts[i] = d
                if d.finish_reason == "error":
                    status = "500 request_failed (in stream)"
                    err = request_failed(rid, d)
                    body = error_body(err.message, err.type, 500, code=err.code, request_id=rid)
                    out.append(data_line(body))
                    left = 0
                    break
                if d.finished:
                    left -= 1
                    out.append(chunks[i][1](d, d.finish_reason))
                elif d.delta_token_ids or d.delta_text:
                    out.append(chunks[i][1](d, None))
            data = b"".join(out)
            if data:
                await emit(data)
        if status == "200" and include_usage:
            usage = choices_usage(lasts, n)
            await emit(chunks[0][0].usage(usage.model_dump()))
    except Exception as exc:  # never a silently cut stream: say so, then [DONE]
        failure = stream_failure(ctx, rid, exc)
        status = failure.status
        await emit(data_line(failure.body(rid)))
    finally:
        await cancel_all(tasks)
        for run, last in zip(runs, lasts, strict=True):
            run.close()
            done = status
            if status == "200":  # no [DONE] reached the client: it went away mid-stream
                done = f"200 {last.finish_reason}" if last and last.finished else "499 client_gone"
            end_request(ctx.metrics, rid, run, last, ttft_s, done, arrival)
    await emit(DONE, True)
