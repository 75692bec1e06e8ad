"""From a routed request's stream to the HTTP response: one JSON body, or SSE.

Why the shape: a request is routed and its first token awaited before the response starts
(:mod:`.intake`), so errors before it get a real status; a failure after it ends the SSE
stream with an ``error`` event, then ``[DONE]`` -- never a silently cut stream. When the
client goes away, Starlette closes the body iterator (streaming) or the handler notices
(non-streaming); closing the :class:`Stream` cancels the request on the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .errors import APIError, one_line, request_id
from .frontdoor import REPLICA_FAILURES, FrontDoor, Stream
from .openai_api import ChatCompletionRequest, CompletionRequest, dumps, error_body, make_usage

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvroute-replica"
DISCONNECT_POLL_S = 0.5
FAILED = "the replica serving this request failed; the request id finds it in the server log"
INTERNAL = "internal error; the request id finds it in the server log"


def request_failed(rid: str, last: Any) -> APIError:
    """A request whose own stage failed on the replica (the others there ran on)."""
    why = one_line(getattr(last, "error", None) or "unknown")
    log.warning("request %s failed on its replica: %s", rid, why)
    return APIError(
        500, f"The request failed on its replica ({why}).", "server_error", code="request_failed"
    )


async def respond(
    door: FrontDoor,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    stream: Stream,
    chunk: Callable[..., dict[str, Any]],
    final: Callable[[str, str | None, Any], dict[str, Any]],
    role_first: bool = False,
) -> Response:
    """The whole answer as one body, or an SSE stream of ``chunk``s."""
    headers = {REPLICA_HEADER: stream.replica}
    rid = request_id(request)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(door, stream, rid, chunk, include_usage, role_first),
            media_type="text/event-stream",
            headers=headers,
        )
    parts: list[str] = []
    finish, last = None, None

    async def collect() -> None:
        nonlocal finish, last
        async for d in stream:
            parts.append(d.delta_text)
            finish, last = d.finish_reason, d

    task = asyncio.ensure_future(collect())
    try:
        # Starlette does not cancel a handler whose client left: watch for it, so an
        # abandoned request stops using the replica.
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                door.errors["client_gone"] += 1
                return Response(status_code=499)  # nobody reads it
        await task
    except REPLICA_FAILURES as exc:
        log.warning("request %s: replica failed mid-request: %s", rid, one_line(str(exc)))
        raise APIError(503, FAILED, "service_unavailable", code="replica_failed") from None
    finally:
        if not task.done():  # cancelling it cancels the request on the replica
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await stream.aclose()
    if finish == "error":
        raise request_failed(rid, last)
    usage = _usage(door, last)
    return JSONResponse(final("".join(parts), finish, usage), headers=headers)


def _usage(door: FrontDoor, last: Any) -> Any:
    if last is None:
        return None
    door.record(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
    return make_usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)


async def _sse(
    door: FrontDoor,
    stream: Stream,
    rid: str,
    chunk: Callable[..., dict[str, Any]],
    include_usage: bool,
    role_first: bool,
) -> AsyncIterator[str]:
    """``data: {json}\\n\\n`` per delta, ``data: [DONE]`` last, whatever happens."""
    last = None
    try:
        if role_first:
            yield _data(chunk("", None, True))
        async for d in stream:
            last = d
            if d.finish_reason == "error":
                err = request_failed(rid, d)
                yield _data(error_body(err.message, err.type, 500, code=err.code, request_id=rid))
                break
            if d.delta_text or d.finished:
                yield _data(chunk(d.delta_text, d.finish_reason if d.finished else None))
        else:
            usage = _usage(door, last)
            if include_usage and usage is not None:
                payload = chunk("", None)
                payload["choices"], payload["usage"] = [], usage.model_dump()
                yield _data(payload)
    except REPLICA_FAILURES as exc:
        door.errors["stream_failure"] += 1
        log.warning("request %s: replica failed mid-stream: %s", rid, one_line(str(exc)))
        body = error_body(FAILED, "service_unavailable", 503, code="replica_failed", request_id=rid)
        yield _data(body)
    except Exception:  # never a silently cut stream: say so, then [DONE]
        log.exception("request %s: stream failed", rid)
        door.errors["internal"] += 1
        body = error_body(INTERNAL, "server_error", 500, code="internal_error", request_id=rid)
        yield _data(body)
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {dumps(obj)}\n\n"
