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
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

import pydantic
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvroute.events.replica_api import (
    BoundsError,
    InvalidRequestError,
    SamplingSpec,
    check_prompt_token_ids,
)

from .errors import (
    APIError,
    RequestIdMiddleware,
    api_error_response,
    error_response,
    one_line,
    read_body,
    request_id,
    validation_error,
)
from .frontdoor import REPLICA_FAILURES, FrontDoor, OverloadedError, QueryOfDeathError, Stream
from .metrics import render_metrics
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
    dumps,
    error_body,
    make_usage,
)
from .policy import NoReplicaError
from .tenants import AuthError, Tenant, Tenants

log = logging.getLogger(__name__)
REPLICA_HEADER = "x-kvroute-replica"
DISCONNECT_POLL_S = 0.5
MAX_BODY_BYTES = 4 << 20  # default cap on a request body, checked before it is parsed
# A token covers at most this many characters in the cheap bound applied before tokenizing
# (the tokenizer's longest vocabulary entry, when it can be read, replaces it).
DEFAULT_CHARS_PER_TOKEN = 32
OFF_LOOP_BODY_BYTES = 64 << 10  # bodies past this are parsed on a worker thread
FAILED = "the replica serving this request failed; the request id finds it in the server log"
M = TypeVar("M", bound=pydantic.BaseModel)


def _authenticate(request: Request) -> Tenant:
    """A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps ``receive``
    and hides a client's disconnect from the handler. The handlers read their body
    themselves, after this has run: a bad or missing key is a 401 whatever the body."""
    state = request.app.state
    try:
        return state.tenants.authenticate(request.headers.get("authorization"))
    except AuthError as exc:
        state.door.errors["auth"] += 1
        raise APIError(401, str(exc), "invalid_request_error", code="invalid_api_key") from None


TenantDep = Annotated[Tenant, Depends(_authenticate)]


def create_app(
    door: FrontDoor,
    tenants: Tenants,
    served_model: str | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The app; it starts ``door``'s restart monitor on its own loop and closes ``door`` on
    shutdown. ``served_model``: the name clients use in ``model`` (default: the replicas'
    configured model). ``max_body_bytes``: a larger body is a 413, refused before it is
    read whole or parsed."""
    model_name = served_model or door.model
    # Parsing big bodies, chat templates and tokenization run here, off the event loop, so
    # one large prompt never stalls /health or other tenants. One thread: a tokenizer is not
    # safe to share between threads.
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvroute-tokenize")
    chars_per_token = _chars_per_token(door.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        door.start()
        try:
            yield
        finally:
            await door.close()
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvroute", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.door, app.state.tenants = door, tenants
    app.add_middleware(
        RequestIdMiddleware, on_internal_error=lambda: door.errors.update(["internal"])
    )
    schemas: dict[str, Any] = {}  # request bodies' sub-models, for /openapi.json

    def body_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
        """The body in the OpenAPI schema (the handlers read the body themselves)."""
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        content = {"application/json": {"schema": schema}}
        return {"requestBody": {"required": True, "content": content}}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = FastAPI.openapi(app)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return api_error_response(request, validation_error(list(exc.errors())))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return api_error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        msg = one_line(str(exc.detail))
        return error_response(
            exc.status_code, msg, "invalid_request_error", rid=request_id(request)
        )

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

    async def off_loop(fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    async def parse(request: Request, model: type[M]) -> M:
        """The body as ``model``: read under the size cap, then validated strictly."""
        raw = await read_body(request, max_body_bytes)
        try:
            if len(raw) > OFF_LOOP_BODY_BYTES:
                return await off_loop(lambda: model.model_validate_json(raw))
            return model.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            raise validation_error(list(exc.errors(include_url=False))) from None

    def check(body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model not in (model_name, door.model):
            # 400 (vLLM answers 404): the body names what is served.
            raise APIError(
                400,
                f"The model `{body.model[:100]}` does not exist; this server serves "
                f"`{model_name}`.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        param = body.unsupported()
        if param is not None:
            raise APIError(
                400,
                f"`{param}` is not supported by this server.",
                "invalid_request_error",
                param,
                "unsupported_parameter",
            )
        if isinstance(body, ChatCompletionRequest):
            for i, m in enumerate(body.messages):
                bad = m.non_text_part()
                if bad is not None:
                    raise APIError(
                        400,
                        f"Content parts of type `{one_line(bad[1])[:40]}` are not supported "
                        "(a text model is served); send `text` parts.",
                        "invalid_request_error",
                        f"messages.{i}.content.{bad[0]}",
                        "unsupported_parameter",
                    )

    def check_length(chars: int) -> None:
        """A cheap bound before tokenizing: so many characters cannot fit the context."""
        if chars > door.max_model_len * chars_per_token:
            raise APIError(
                400,
                f"The prompt is longer than this model's context of {door.max_model_len} "
                "tokens can hold.",
                "invalid_request_error",
                "prompt",
                "context_length_exceeded",
            )

    def check_ids(ids: list[int]) -> None:
        vocab = [r.info.vocab_size for r in door.replicas.values() if r.info.vocab_size]
        try:
            check_prompt_token_ids(ids, min(vocab, default=None))
        except BoundsError as exc:
            raise APIError(400, str(exc), "invalid_request_error", exc.param) from None

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
                "context_length_exceeded",
            )
        try:  # the shared bounds, as the engine will check them
            return SamplingSpec(
                max_tokens=max_tokens or room,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(body.top_k or 0, 0),
                seed=body.seed,
                stop=body.stop_list(),
                stop_token_ids=list(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                min_tokens=body.min_tokens or 0,
            )
        except BoundsError as exc:
            raise APIError(400, str(exc), "invalid_request_error", exc.param) from None

    async def open_stream(
        request: Request, tenant: Tenant, ids: list[int], spec: SamplingSpec, salt: str | None
    ) -> Stream:
        rid = request_id(request)
        try:
            stream = await door.open(tenant, ids, spec, salt, request_id=rid)
            if stream.first is not None and stream.first.finish_reason == "error":
                await stream.aclose()  # failed before its first token: a status can say so
                raise _request_failed(rid, stream.first)
            return stream
        except InvalidRequestError as exc:
            raise APIError(400, one_line(str(exc)), "invalid_request_error") from None
        except QueryOfDeathError as exc:
            raise APIError(
                400, str(exc), "invalid_request_error", code="request_quarantined"
            ) from None
        except OverloadedError as exc:
            raise APIError(
                429, str(exc), "rate_limit_exceeded", code="rate_limit_exceeded",
                headers={"retry-after": "1"},
            ) from None  # fmt: skip
        except NoReplicaError as exc:
            raise APIError(
                503, str(exc), "service_unavailable", headers={"retry-after": "1"}
            ) from None
        except REPLICA_FAILURES as exc:
            log.warning("request %s: replica failed: %s", rid, one_line(str(exc)))
            suspect = getattr(exc, "suspect", False)
            msg = FAILED + (
                "; it was not retried elsewhere, as it may have caused the failure"
                if suspect
                else ""
            )
            raise APIError(503, msg, "service_unavailable", code="replica_failed") from None

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request, tenant: TenantDep) -> Any:
        body = await parse(request, CompletionRequest)
        check(body)
        if isinstance(body.prompt, str):
            text = body.prompt
            check_length(len(text))
            ids = await off_loop(lambda: list(door.tokenizer(text).input_ids))
        else:
            ids = list(body.prompt)
        check_ids(ids)
        spec = sampling(body, len(ids))
        stream = await open_stream(request, tenant, ids, spec, body.cache_salt)
        rid = f"cmpl-{uuid.uuid4().hex}"

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            choice = CompletionChoice(text=text, finish_reason=finish)
            return CompletionResponse(id=rid, model=body.model, choices=[choice]).model_dump()

        def final(text: str, finish: str | None, usage: Any) -> dict[str, Any]:
            choice = CompletionChoice(text=text, finish_reason=finish)
            resp = CompletionResponse(id=rid, model=body.model, choices=[choice], usage=usage)
            return resp.model_dump()

        return await respond(request, body, stream, chunk, final)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat(request: Request, tenant: TenantDep) -> Any:
        body = await parse(request, ChatCompletionRequest)
        check(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_length(sum(len(m["content"]) for m in messages))

        def render() -> list[int]:
            text = door.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return list(door.tokenizer(text, add_special_tokens=False).input_ids)

        try:
            ids = await off_loop(render)
        except Exception as exc:  # no template, or the template rejects the roles
            log.warning("request %s: chat template failed", request_id(request), exc_info=True)
            raise APIError(
                400, f"cannot render chat: {one_line(str(exc))}", "invalid_request_error"
            ) from None
        check_ids(ids)
        stream = await open_stream(request, tenant, ids, sampling(body, len(ids)), body.cache_salt)
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

        return await respond(request, body, stream, chunk, final, role_first=True)

    async def respond(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        stream: Stream,
        chunk: Callable[..., dict[str, Any]],
        final: Callable[[str, str | None, Any], dict[str, Any]],
        role_first: bool = False,
    ) -> Any:
        headers = {REPLICA_HEADER: stream.replica}
        rid = request_id(request)
        if not body.stream:
            parts, finish, last = [], None, None

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
                log.warning("request %s: replica failed mid-request: %s", rid, one_line(str(exc)))
                raise APIError(503, FAILED, "service_unavailable", code="replica_failed") from None
            finally:
                if not task.done():  # cancelling it cancels the request on the replica
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                await stream.aclose()
            if finish == "error":
                raise _request_failed(rid, last)
            usage = _usage(door, last)
            return JSONResponse(final("".join(parts), finish, usage), headers=headers)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(door, stream, rid, chunk, include_usage, role_first),
            media_type="text/event-stream",
            headers=headers,
        )

    return app


def _chars_per_token(tokenizer: Any) -> int:
    """The most characters one token can stand for (its longest vocabulary entry)."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=0)
    except Exception:  # a stand-in tokenizer in tests
        return DEFAULT_CHARS_PER_TOKEN
    return max(longest, 1)


def _request_failed(rid: str, last: Any) -> APIError:
    """A request whose own stage failed on the replica (the others there ran on)."""
    why = one_line(getattr(last, "error", None) or "unknown")
    log.warning("request %s failed on its replica: %s", rid, why)
    return APIError(
        500, f"The request failed on its replica ({why}).", "server_error", code="request_failed"
    )


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
                err = _request_failed(rid, d)
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
        body = error_body(
            "internal error; the request id finds it in the server log", "server_error", 500,
            code="internal_error", request_id=rid,
        )  # fmt: skip
        yield _data(body)
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {dumps(obj)}\n\n"
