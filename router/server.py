"""The OpenAI-compatible HTTP front door (FastAPI) over a :class:`FrontDoor`.

Why the shape:
- Chat templates are rendered and prompts tokenized here, router-side (DESIGN, "The request
  path"): the router must hash exactly the tokens the engine will see.
- A request is routed and its first token awaited before the response starts, so errors
  before it get a real status (400, 503) and the ``x-kvroute-replica`` header can name the
  replica; a failure after it ends the SSE stream with an ``error`` event, then ``[DONE]``.
- When the client goes away mid-stream, Starlette closes the body iterator; closing the
  :class:`Stream` cancels the request on the replica (its blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvroute.events import ReplicaStats
from kvroute.events.replica_api import InvalidRequestError, SamplingSpec

from .frontdoor import REPLICA_FAILURES, FrontDoor, OverloadedError, Stream
from .openai_api import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    error_body,
    make_usage,
)
from .policy import NoReplicaError
from .tenants import AuthError, Tenant, Tenants

log = logging.getLogger(__name__)
REPLICA_HEADER = "x-kvroute-replica"
DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    """Raised by a handler; answered with an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )


def _error(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param, code), status_code=status)


def _authenticate(request: Request) -> Tenant:
    """A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps ``receive``
    and hides a client's disconnect from the handler. Dependencies run before the body is
    validated, so a bad key is a 401 whatever the body."""
    state = request.app.state
    try:
        return state.tenants.authenticate(request.headers.get("authorization"))
    except AuthError as exc:
        state.door.errors["auth"] += 1
        raise APIError(401, str(exc), "invalid_request_error", code="invalid_api_key") from None


TenantDep = Annotated[Tenant, Depends(_authenticate)]


def create_app(door: FrontDoor, tenants: Tenants, served_model: str | None = None) -> FastAPI:
    """The app; it starts ``door``'s restart monitor on its own loop and closes ``door`` on
    shutdown. ``served_model``: the name clients use in ``model`` (default: the replicas'
    configured model)."""
    model_name = served_model or door.model

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        door.start()
        try:
            yield
        finally:
            await door.close()

    app = FastAPI(title="kvroute", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.door, app.state.tenants = door, tenants

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg", "invalid body"))
        return _error(400, msg, "invalid_request_error", param)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=exc)
        door.errors["internal"] += 1
        return _error(500, f"internal error: {type(exc).__name__}", "internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = door.alive()
        status = 200 if alive else 503
        return JSONResponse({"status": "ok" if alive else "no replica", "replicas": alive}, status)

    @app.get("/v1/models")
    async def models(_: TenantDep) -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=door.max_model_len)])

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        events = await asyncio.to_thread(door.subscriber.stats)  # a hop to its thread
        text = render_metrics(door, events)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def check_model(model: str) -> None:
        if model not in (model_name, door.model):
            # 400 (vLLM answers 404): the body names what is served.
            raise APIError(
                400,
                f"The model `{model}` does not exist; this server serves `{model_name}`.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def sampling(body: CompletionRequest | ChatCompletionRequest, n_prompt: int) -> SamplingSpec:
        room = door.max_model_len - n_prompt
        max_tokens = body.max_tokens
        if isinstance(body, ChatCompletionRequest):
            max_tokens = body.max_completion_tokens or max_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {door.max_model_len} tokens; the "
                f"prompt has {n_prompt} tokens and max_tokens is {max_tokens}.",
                "invalid_request_error",
                "max_tokens",
            )
        return SamplingSpec(
            max_tokens=max_tokens or room,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=body.stop_list(),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
        )

    async def open_stream(
        tenant: Tenant, ids: list[int], spec: SamplingSpec, salt: str | None
    ) -> Stream:
        if not ids:
            raise APIError(400, "The prompt is empty.", "invalid_request_error", "prompt")
        try:
            return await door.open(tenant, ids, spec, salt)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from None
        except OverloadedError as exc:
            raise APIError(
                429, str(exc), "rate_limit_exceeded", code="rate_limit_exceeded"
            ) from None
        except NoReplicaError as exc:
            raise APIError(503, str(exc), "service_unavailable") from None
        except REPLICA_FAILURES as exc:
            raise APIError(503, f"replica failed: {exc}", "service_unavailable") from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: TenantDep) -> Any:
        check_model(body.model)
        if isinstance(body.prompt, str):
            ids = door.tokenizer(body.prompt).input_ids
        else:
            ids = list(body.prompt)
        stream = await open_stream(tenant, ids, sampling(body, len(ids)), body.cache_salt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        prefix = body.prompt if body.echo and isinstance(body.prompt, str) else ""

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            choice = CompletionChoice(text=text, finish_reason=finish)
            return CompletionResponse(id=rid, model=body.model, choices=[choice]).model_dump()

        def final(text: str, finish: str | None, usage: Any) -> dict[str, Any]:
            choice = CompletionChoice(text=text, finish_reason=finish)
            resp = CompletionResponse(id=rid, model=body.model, choices=[choice], usage=usage)
            return resp.model_dump()

        return await respond(request, body, stream, prefix, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, tenant: TenantDep) -> Any:
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = door.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # no template, or the template rejects the roles
            raise APIError(400, f"cannot render chat: {exc}", "invalid_request_error") from None
        ids = door.tokenizer(text, add_special_tokens=False).input_ids
        stream = await open_stream(tenant, ids, sampling(body, len(ids)), body.cache_salt)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def chunk(text: str, finish: str | None, role: bool = False) -> dict[str, Any]:
            delta = ChatDelta(role="assistant" if role else None, content=text if text else None)
            choice = ChatStreamChoice(delta=delta, finish_reason=finish)
            out = ChatCompletionChunk(id=rid, created=created, model=body.model, choices=[choice])
            return out.model_dump()

        def final(text: str, finish: str | None, usage: Any) -> dict[str, Any]:
            msg = ChatDelta(role="assistant", content=text)
            choice = ChatChoice(message=msg, finish_reason=finish)
            resp = ChatCompletionResponse(id=rid, model=body.model, choices=[choice], usage=usage)
            return resp.model_dump()

        return await respond(request, body, stream, "", chunk, final, role_first=True)

    async def respond(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        stream: Stream,
        prefix: str,
        chunk: Callable[..., dict[str, Any]],
        final: Callable[[str, str | None, Any], dict[str, Any]],
        role_first: bool = False,
    ) -> Any:
        headers = {REPLICA_HEADER: stream.replica}
        if not body.stream:
            parts, finish, last = [prefix], None, None

            async def collect() -> None:
                nonlocal finish, last
                async for d in stream:
                    parts.append(d.delta_text)
                    finish, last = d.finish_reason, d

            task = asyncio.ensure_future(collect())
            gone = False
            try:
                # Starlette does not cancel a handler whose client left: watch for it, so
                # an abandoned request stops using the replica.
                while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                    if await request.is_disconnected():
                        door.errors["client_gone"] += 1
                        gone = True
                        break
                if gone:
                    return Response(status_code=499)  # nobody reads it
                await task
            except REPLICA_FAILURES as exc:
                raise APIError(
                    503, f"replica failed mid-request: {exc}", "service_unavailable"
                ) from None
            finally:
                if not task.done():  # cancelling it cancels the request on the replica
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                await stream.aclose()
            usage = _usage(door, last)
            return JSONResponse(final("".join(parts), finish, usage), headers=headers)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(door, stream, prefix, chunk, include_usage, role_first),
            media_type="text/event-stream",
            headers=headers,
        )

    return app


def _usage(door: FrontDoor, last: Any) -> Any:
    if last is None:
        return None
    door.record(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
    return make_usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)


async def _sse(
    door: FrontDoor,
    stream: Stream,
    prefix: str,
    chunk: Callable[..., dict[str, Any]],
    include_usage: bool,
    role_first: bool,
) -> AsyncIterator[str]:
    """``data: {json}\\n\\n`` per delta, ``data: [DONE]`` last, whatever happens."""
    last = None
    try:
        if role_first:
            yield _data(chunk("", None, True))
        if prefix:
            yield _data(chunk(prefix, None))
        async for d in stream:
            last = d
            if d.delta_text or d.finished:
                yield _data(chunk(d.delta_text, d.finish_reason if d.finished else None))
        usage = _usage(door, last)
        if include_usage and usage is not None:
            payload = chunk("", None)
            payload["choices"], payload["usage"] = [], usage.model_dump()
            yield _data(payload)
    except REPLICA_FAILURES as exc:
        door.errors["stream_failure"] += 1
        yield _data(error_body(f"replica failed mid-stream: {exc}", "service_unavailable", 503))
    except Exception as exc:  # never a silently cut stream: say so, then [DONE]
        log.exception("stream failed")
        door.errors["internal"] += 1
        yield _data(error_body(f"internal error: {type(exc).__name__}", "internal_error", 500))
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def render_metrics(door: FrontDoor, events: dict[str, ReplicaStats] | None = None) -> str:
    """Prometheus text exposition, by hand (no client library needed for a few series)."""
    c, lines = door.counters, []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP kvroute_{name} {help_}", f"# TYPE kvroute_{name} {kind}"])
        lines.extend(f"kvroute_{name}{labels} {value:g}" for labels, value in samples)

    metric("requests_total", "counter", "Requests routed.", [("", c["requests"])])
    metric("retries_total", "counter", "Requests retried on another replica.",
           [("", c["retries"])])  # fmt: skip
    metric("prompt_tokens_total", "counter", "Prompt tokens served.", [("", c["prompt_tokens"])])
    metric("completion_tokens_total", "counter", "Tokens generated.",
           [("", c["completion_tokens"])])  # fmt: skip
    metric("cached_tokens_total", "counter", "Prompt tokens served from a prefix cache.",
           [("", c["cached_tokens"])])  # fmt: skip
    metric("errors_total", "counter", "Errors by kind.",
           [(f'{{kind="{k}"}}', v) for k, v in sorted(door.errors.items())])  # fmt: skip
    reps = sorted(door.replicas.items())
    metric("replica_up", "gauge", "1 while the replica is routable.",
           [(f'{{replica="{r}"}}', float(x.alive)) for r, x in reps])  # fmt: skip
    metric("replica_routed_total", "counter", "Requests served per replica.",
           [(f'{{replica="{r}"}}', x.routed) for r, x in reps])  # fmt: skip
    metric("index_blocks", "gauge", "Blocks the prefix index holds per replica.",
           [(f'{{replica="{r}"}}', door.index.num_blocks(r)) for r, _ in reps])  # fmt: skip
    ev = sorted((events or {}).items())
    for field, help_ in (
        ("delivered", "Event batches applied to the index."),
        ("gaps", "Event seq gaps detected (recovered by replay or snapshot)."),
        ("restarts", "Engine restarts seen on the event stream."),
        ("resets", "Times a replica's indexed state was dropped and rebuilt."),
    ):
        metric(f"events_{field}_total", "counter", help_,
               [(f'{{replica="{r}"}}', getattr(st, field)) for r, st in ev])  # fmt: skip
    return "\n".join(lines) + "\n"
