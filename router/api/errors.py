"""Errors as a client sees them: the OpenAI shape, one line, and a request id.

Why: an error body is read by people and by SDKs, and nothing of the server's insides
(remote tracebacks, pids, addresses, colour codes) belongs in it. Every response carries an
``x-request-id`` header; an error body repeats it, and the server's log line for the
failure names it, so the full trace is one search away for whoever runs the server.

The request id is set by a plain ASGI middleware rather than Starlette's
``BaseHTTPMiddleware``, which wraps ``receive`` and would hide a client's disconnect from the
handlers (they cancel abandoned requests on the replica). The same middleware turns an
unhandled exception into a 500 that still carries the id.

On a request's path this module is no stop of its own: it is the vocabulary every stop
raises in (:class:`APIError`) and the one place a router failure becomes the status a
client sees (:func:`status_of`, :func:`request_failed`), so no stop calls another back to
ask.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvroute.events.replica_api import InvalidRequestError

from ..fleet.flow import ShedError
from ..fleet.request_run import REPLICA_FAILURES
from ..routing.policy import NoReplicaError
from .openai_api import dumps, error_body

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
MAX_MESSAGE_CHARS = 300
# Union branches pydantic puts in an error's path (``prompt.list[int].0``): not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")

# Request and response ids: 128 random bits, as uuid4's hex, from a generator seeded by the
# OS once (and again in a forked child) instead of an ``os.urandom`` system call per id --
# two per request, and a system call costs more than the generator (``ids`` in
# benchmarks/bench_hot_lane.py). Ids name requests; they are no secret and no key.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def new_id() -> str:
    """32 hex digits, unique with uuid4's odds (it is not a credential)."""
    return f"{_ids.getrandbits(128):032x}"


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lowercase) straight from the ASGI scope, as
    Starlette's ``request.headers.get`` reads it, without building its header list."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")  # type: ignore[no-any-return]
    return None


class APIError(Exception):
    """Raised by a handler; answered with an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.headers = param, code, headers


def one_line(text: str) -> str:
    """The first non-empty line of ``text``, colour codes stripped, at most a few hundred
    characters: what an exception's text may contribute to an error message."""
    text = _ANSI.sub("", text)
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if len(line) > MAX_MESSAGE_CHARS:
        line = line[: MAX_MESSAGE_CHARS - 3] + "..."
    return line


def request_id(request: Request) -> str:
    """The id :class:`RequestIdMiddleware` gave this request (``request.state`` is a view of
    ``scope["state"]``: read it there, without making the view)."""
    state = request.scope.get("state")
    return str((state.get("request_id") if state else None) or "")


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    rid: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = error_body(message, type_, status, param, code, rid or None)
    return Response(dumps(body), status, headers=headers, media_type="application/json")


INTERNAL_ERROR = "internal error; the request id finds it in the server log"


def internal_error_response(rid: str) -> Response:
    """The 500 a request gets when its handler raised before its status went out."""
    return error_response(500, INTERNAL_ERROR, "server_error", code="internal_error", rid=rid)


def api_error_response(request: Request, exc: APIError) -> Response:
    return error_response(
        exc.status, exc.message, exc.type, exc.param, exc.code, request_id(request), exc.headers
    )


class RequestIdMiddleware:
    """Gives every HTTP request an id (``request.state.request_id``), returns it in the
    ``x-request-id`` header, and answers an unhandled exception with a 500 naming it."""

    def __init__(
        self,
        app: ASGIApp,
        on_internal_error: Callable[[], Any] | None = None,
        on_response: Callable[[Scope, int], Any] | None = None,
    ) -> None:
        """``on_response(scope, status)``: once per response, when its status is sent."""
        self.app = app
        self.on_internal_error = on_internal_error
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req-{new_id()}"
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, rid)
                if self.on_response is not None:
                    self.on_response(scope, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s failed (%s %s)", rid, scope.get("method"), scope.get("path"))
            if self.on_internal_error is not None:
                self.on_internal_error()
            if started:  # the status is out: the body simply ends
                return
            await internal_error_response(rid)(scope, receive, send_with_id)


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, refused (413) past ``limit`` bytes before more than that is read:
    a declared length is checked first, a chunked body as it arrives. A body that has not
    arrived whole within ``timeout_s`` is a 408: a slow client cannot hold a handler (and
    its memory) for as long as it likes."""
    declared = header(request.scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, _too_large(limit), "invalid_request_error", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    receive = request.receive

    async def read() -> None:
        # ``receive`` itself, as Starlette's ``request.stream()`` reads it, without its
        # async generator (whose first step the loop registers in a WeakSet).
        nonlocal size
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise APIError(
                    413, _too_large(limit), "invalid_request_error", code="body_too_large"
                )
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return

    try:
        async with asyncio.timeout(timeout_s):  # no task of its own, as wait_for would make
            await read()
    except TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout_s:g} s.",
            "invalid_request_error",
            code="body_timeout",
        ) from None
    return b"".join(chunks)


def validation_error(errors: list[Any]) -> APIError:
    """A pydantic error list as one 400 naming the most specific field (union branches such
    as ``list[int]`` dropped from the path)."""
    if not errors:
        return APIError(400, "invalid body", "invalid_request_error")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [
        str(p)
        for p in first.get("loc", ())
        if p != "body"
        and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))
        and not (isinstance(p, str) and p.startswith("constrained-"))
    ]
    # A path may hold the client's own text (a logit_bias key): its repr if it is not a
    # plain name, shortened, so the message stays one line of bounded length.
    loc = [p if (p.isidentifier() or p.isdigit()) and len(p) <= 40 else repr(p)[:40] for p in loc]
    param = ".".join(loc) or None
    msg = one_line(str(first.get("msg", "invalid body")))
    return APIError(
        400, one_line(f"{param}: {msg}") if param else msg, "invalid_request_error", param
    )


FAILED = "the replica serving this request failed; the request id finds it in the server log"
# A replica's refusal that names the request field at fault, as ``field: why``
# (``model``: the LoRA adapter it names cannot be served there, e.g. changed on disk)
_NAMED = re.compile(r"(?:request rejected: )?(structured_outputs|prompt_logprobs|prompt|model):")


def status_of(rid: str, exc: BaseException) -> BaseException:
    """A failure before a request's first token as the status that says it (others
    unchanged): a replica's refusal is the client's 400, no replica a 503, a failed
    replica a 503 that says whether it was retried."""
    if isinstance(exc, InvalidRequestError):
        message = one_line(str(exc))
        named = _NAMED.match(message)  # the replica's "field: why", e.g. a bad constraint
        return APIError(400, message, "invalid_request_error", named and named.group(1))
    if isinstance(exc, ShedError):  # flow control's refusal: the queue or a deadline
        return APIError(429, str(exc), "rate_limit_exceeded", code=f"flow_{exc.cause}",
                        headers={"retry-after": exc.retry_after})  # fmt: skip
    if isinstance(exc, NoReplicaError):
        return APIError(503, str(exc), "service_unavailable", exc.param, exc.code,
                        headers={"retry-after": "1"})  # fmt: skip
    if isinstance(exc, REPLICA_FAILURES):
        log.warning("request %s: replica failed: %s", rid, one_line(str(exc)))
        suspect = getattr(exc, "suspect", False)
        msg = FAILED + (
            "; it was not retried elsewhere, as it may have caused the failure" if suspect else ""
        )
        return APIError(503, msg, "service_unavailable", code="replica_failed")
    return exc


def request_failed(rid: str, last: Any) -> APIError:
    """A request whose own stage failed on the replica (the others there ran on)."""
    why = one_line(getattr(last, "error", None) or "unknown")
    log.warning("request %s failed on its replica: %s", rid, why)
    return APIError(
        500, f"The request failed on its replica ({why}).", "server_error", code="request_failed"
    )


def _too_large(limit: int) -> str:
    return f"The request body exceeds this server's limit of {limit} bytes."


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """How a stream that failed after its status went out ends: the status its request's
    end is logged with, and the error it tells the client (as an ``error`` body/event)."""

    status: str
    http: int
    message: str
    type: str
    code: str

    def body(self, rid: str) -> dict[str, Any]:
        """The error as a chat's or completion's stream sends it (``{"error": {...}}``)."""
        return error_body(self.message, self.type, self.http, code=self.code, request_id=rid)


_REPLICA_FAILED = StreamFailure(
    "503 replica_failed (in stream)", 503, FAILED, "service_unavailable", "replica_failed"
)
_INTERNAL = StreamFailure(
    "500 internal_error (in stream)", 500, INTERNAL_ERROR, "server_error", "internal_error"
)


def stream_failure(ctx: Any, rid: str, exc: Exception) -> StreamFailure:
    """What a stream's writer raised after its first chunk, made one answer for every
    stream (one choice, several, the Responses API's), so they fail alike: a replica's
    failure is a 503 ``replica_failed`` (counted as ``stream_failure``), anything else a
    500 ``internal_error`` (counted, its traceback logged: call it inside the ``except``)."""
    if isinstance(exc, REPLICA_FAILURES):
        ctx.errors["stream_failure"] += 1
        log.warning("request %s: replica failed mid-stream: %s", rid, one_line(str(exc)))
        return _REPLICA_FAILED
    log.exception("request %s: stream failed", rid)
    ctx.errors["internal"] += 1
    return _INTERNAL
