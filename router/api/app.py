"""The OpenAI-compatible HTTP front door (FastAPI) over a :class:`FrontDoor`.

Why the shape:
- Chat templates are rendered and prompts tokenized here, router-side (docs/architecture.md,
  "The request path"): the router must hash exactly the tokens the engine will see. How a
  body becomes a routed request is :mod:`.intake`; how its runs become a response,
  :mod:`.responses`; what an error looks like, :mod:`.errors`. This module does what is
  HTTP's -- the request id, authentication, reading the body under its cap and deadline --
  and wires the rest: one module-level handler per endpoint, the per-app state on
  ``app.state``, each part handed what it needs in :func:`create_app`.
- Authentication is a dependency and the handlers read their body themselves, after it: a
  missing or bad key is a 401 whatever the body (FastAPI would parse a declared body first).
- A request is routed and its first token awaited before the response starts, so errors
  before it get a real status (400, 500, 503) and the ``x-kvroute-replica`` header can name
  the replica; a failure after it ends the SSE stream with an ``error`` event, ``[DONE]``.

The path of one completion request, each module crossed once, downwards: here
(:class:`_DirectEndpoint`: the request id, the tenant); :mod:`.intake` (admit, read the
body through :func:`~.errors.read_body`, parse, check, tokenize, one run per choice from
the front door, routed and sent); :mod:`.responses` or :mod:`.choices.respond` (the first
delta awaited, then the body, or the stream written by :mod:`.sse`; the end recorded in
:mod:`.metrics`). ``python benchmarks/request_files.py`` lists the files it crosses.

An :class:`~.errors.APIError` raised anywhere on the way comes back here as its response.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Annotated, Any

import pydantic
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..fleet.tenants import AuthError, Tenant, Tenants
from ..frontdoor import FrontDoor
from .admin.fleet_view import fleet_view
from .admin.lora_admin import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    load_lora_adapter,
    require_admin,
    unload_lora_adapter,
)
from .admin.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .agents.responses_api import create_response
from .agents.responses_input import ResponsesRequest
from .agents.tools import ToolConfig
from .choices.echo import Echo
from .choices.respond import respond_choices
from .choices.stream import stream_choices
from .errors import (
    REQUEST_ID_HEADER,
    APIError,
    RequestIdMiddleware,
    api_error_response,
    error_response,
    header,
    internal_error_response,
    new_id,
    one_line,
    read_body,
    request_id,
    validation_error,
)
from .intake import Intake, runs_per_prompt
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import render_metrics
from .openai_api import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from .priority import SLO_HEADERS, read_hints
from .responses import REPLICA_HEADER, ResponseContext, respond
from .send_deadline import SEND_TIMEOUT_S, ClientTooSlowError, SendDeadlineMiddleware
from .sse import RAW_SEND, SSEResponse

__all__ = ["BODY_TIMEOUT_S", "MAX_BODY_BYTES", "REPLICA_HEADER", "create_app", "render_metrics"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # default cap on a request body, checked before it is parsed
BODY_TIMEOUT_S = 30.0  # default time for a body to arrive whole (a 408 past it)


async def _authenticate(request: Request) -> Tenant:
    """A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps ``receive``
    and hides a client's disconnect from the handler. The handlers read their body
    themselves, after this has run: a bad or missing key is a 401 whatever the body.
    Async, though it never awaits: FastAPI runs a plain function on a worker thread, a
    thread hop per request for a dictionary lookup."""
    return authenticate(request.scope, request.app.state)


def authenticate(scope: Scope, state: Any) -> Tenant:
    """The request's tenant from its ``Authorization`` header (read from the scope, no
    header list built), noted in ``scope["state"]`` for the status counter; else a 401."""
    try:
        tenant: Tenant = state.tenants.authenticate(header(scope, b"authorization"))
    except AuthError as exc:
        state.errors["auth"] += 1
        raise APIError(401, str(exc), "invalid_request_error", code="invalid_api_key") from None
    scope.setdefault("state", {})["tenant"] = tenant.tenant_id
    return tenant


TenantDep = Annotated[Tenant, Depends(_authenticate)]


async def health(request: Request) -> JSONResponse:
    alive = request.app.state.fleet.alive()
    status = 200 if alive else 503
    return JSONResponse({"status": "ok" if alive else "no replica", "replicas": alive}, status)


async def fleet(request: Request) -> JSONResponse:
    """Admin keys only: 401 without a known key, 403 for a tenant's key. A server without
    keys answers anyone only while it listens on loopback: the view names hosts and pids."""
    require_admin(request, "/fleet")
    return JSONResponse(request.app.state.fleet_view())


async def models(request: Request, tenant: TenantDep) -> ModelList:
    """The base model, then the LoRA adapters ``tenant`` may use (as vLLM lists them:
    ``parent`` the base model's id, ``root`` the adapter's folder)."""
    state = request.app.state
    fleet = state.fleet
    base = state.intake.model_name
    card = ModelCard(
        id=base,
        root=fleet.model_path,
        max_model_len=fleet.max_model_len,
        vocab_size=fleet.vocab_size(),
    )
    adapters = [
        ModelCard(
            id=a.name,
            created=a.created,
            root=a.path,
            parent=base,
            max_model_len=fleet.max_model_len,
            vocab_size=card.vocab_size,
        )
        for a in state.door.loras.visible(tenant)
    ]
    return ModelList(data=[card, *adapters])


async def metrics(request: Request) -> Response:
    """An admin key or the metrics key (``--metrics-key``): 401 without a known key, 403
    for a tenant's -- the series name every tenant and LoRA adapter, with its traffic,
    which no tenant may learn of another. A server without any key answers anyone."""
    state = request.app.state
    try:
        allowed = state.tenants.may_scrape(request.headers.get("authorization"))
    except AuthError as exc:
        state.errors["auth"] += 1
        raise APIError(401, str(exc), "invalid_request_error", code="invalid_api_key") from None
    if not allowed:
        raise APIError(
            403,
            "/metrics needs an admin key or the metrics key (--metrics-key)",
            "permission_error",
            code="not_admin",
        )
    return Response(state.metrics_text(), media_type=METRICS_CONTENT_TYPE)


async def completions(request: Request, tenant: TenantDep) -> Response:
    return await _serve(request, tenant, CompletionRequest)


async def chat_completions(request: Request, tenant: TenantDep) -> Response:
    return await _serve(request, tenant, ChatCompletionRequest)


async def responses(request: Request, tenant: TenantDep) -> Response:
    """OpenAI's Responses API, stateless (:mod:`.responses_api`)."""
    return await create_response(request, tenant)


async def _serve(request: Request, tenant: Tenant, model: type[Any]) -> Response:
    """Both completion endpoints (the path in the module's docstring): the request's runs
    (one per choice) are sent by intake; until the response owns them, any failure here
    closes them."""
    arrival = time.perf_counter()
    state = request.app.state
    rid = request_id(request)
    intake: Intake = state.intake
    # Read by intake once admitted: a refused request is never read.
    read = partial(read_body, request, state.max_body_bytes, state.body_timeout_s)
    scope, by_header = request.scope, state.priority_header
    hints = None  # most requests carry no class header: :mod:`.priority` is not asked
    if by_header or any(header(scope, name) is not None for name in SLO_HEADERS):
        hints = read_hints(scope, by_header)
    admitted = await intake.begin(tenant, model, read, rid, hints)
    body, runs = admitted.body, admitted.runs
    try:
        echo = None
        if admitted.prompts is not None and body.echo:
            decode = intake.tokenizer.decode
            n = runs_per_prompt(body)
            echo = Echo.of(admitted.prompts, runs, n, decode, alone=body.max_tokens == 0)
        ctx: ResponseContext = state.responses
        tools = admitted.tools
        if len(runs) > 1 and body.stream:
            return stream_choices(ctx, request, rid, body, runs, arrival, echo, tools)
        if len(runs) > 1:
            return await respond_choices(ctx, request, rid, body, runs, arrival, echo, tools)
        return await respond(ctx, request, rid, body, runs[0], arrival, echo, tools)
    except BaseException:
        for run in runs:
            run.close()
        raise


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return api_error_response(request, validation_error(list(errors)))


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return api_error_response(request, exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    msg = one_line(str(exc.detail))
    return error_response(exc.status_code, msg, "invalid_request_error", rid=request_id(request))


Handler = Callable[[Request, Tenant], Awaitable[Response]]


class _App(FastAPI):
    """FastAPI that keeps the server's own ``send`` in the scope, outside every middleware
    (Starlette's error middleware included): SSE chunks go on it (:mod:`.sse`).

    The two completion endpoints go straight past FastAPI's stack (its error, telemetry and
    body-limit middleware, the router, dependency solving) and past kvroute's middleware
    objects: :class:`_DirectEndpoint` does what they do, in one layer. They need
    nothing else of it: they read their own body, and their only exception is
    :class:`APIError`. Every other path is FastAPI's, through the middleware."""

    direct_endpoints: dict[str, ASGIApp]  # path -> its _DirectEndpoint (POST only)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
            direct = self.direct_endpoints.get(scope["path"]) if scope["method"] == "POST" else None
            if direct is not None:
                scope["app"] = self
                await direct(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


class _DirectEndpoint:
    """One completion endpoint as one bare ASGI app: what the middleware stack does for
    every other path -- a request id (``x-request-id``, ``request.state.request_id``), the
    status counter, a deadline on each send through it (:mod:`.send_deadline`), an
    unhandled exception as a 500 naming the id (:class:`~.errors.RequestIdMiddleware`) --
    and what FastAPI's dependency and exception handler do (authentication, an
    :class:`APIError` as its OpenAI-style response), with one closure per request instead
    of a wrapper per layer. An SSE response sends its head and body on the server's raw
    ``send``, given the id header and the status counter (:mod:`.sse`): nothing in a
    stream calls back into this module. A JSON body passes through here."""

    def __init__(
        self,
        handler: Handler,
        state: Any,
        send_timeout_s: float | None,
        count_response: Callable[[Any, int], None],
    ) -> None:
        self.handler = handler
        self.state = state
        self.send_timeout_s = send_timeout_s
        self.count_response = count_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = f"req-{new_id()}"
        scope.setdefault("state", {})["request_id"] = rid
        id_header = (REQUEST_ID_HEADER.encode(), rid.encode())
        timeout = self.send_timeout_s
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), id_header]
                self.count_response(scope, message["status"])
            if timeout is None:
                await send(message)
                return
            try:  # the start too: a kept-alive client may have stopped reading already
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                raise ClientTooSlowError from None

        errors = self.state.errors
        response: Any = None
        try:
            request = Request(scope, receive)
            try:
                response = await self.handler(request, authenticate(scope, self.state))
                if isinstance(response, SSEResponse):  # its head goes raw too (sse.py)
                    response.head_extra = [id_header]
                    response.on_head = partial(self.count_response, scope)
                await response(scope, receive, send_with_id)
            except APIError as exc:  # from the handler, or a stream's before its head
                if started or getattr(response, "head_sent", False):
                    raise
                await api_error_response(request, exc)(scope, receive, send_with_id)
        except ClientTooSlowError:
            log.warning("request %s: the client took nothing for %g s; dropped", rid, timeout)
            errors["slow_client"] += 1
        except Exception:
            log.exception("request %s failed (%s %s)", rid, scope.get("method"), scope.get("path"))
            errors["internal"] += 1
            if started or getattr(response, "head_sent", False):  # the status is out: the
                return  # body simply ends

            async def send_plain(message: Message) -> None:  # no deadline, as before
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), id_header]
                    self.count_response(scope, message["status"])
                await send(message)

            await internal_error_response(rid)(scope, receive, send_plain)


def freeze_startup_heap() -> None:
    """Moves everything alive now (Ray, FastAPI, transformers and their modules: hundreds
    of thousands of objects) out of the garbage collector's reach. A full collection walked
    them all, a pause in which no stream moved; after the freeze it skips them. Objects made
    later are collected as before."""
    gc.collect()
    gc.freeze()


def create_app(
    door: FrontDoor,
    tenants: Tenants,
    served_model: str | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float | None = BODY_TIMEOUT_S,
    send_timeout_s: float | None = SEND_TIMEOUT_S,
    public: bool = False,
    tools: ToolConfig | None = None,
    priority_header: str | None = None,
) -> FastAPI:
    """The app; it starts ``door``'s restart monitor on its own loop and closes ``door`` on
    shutdown. ``served_model``: the name clients use in ``model`` (default: the replicas'
    configured model). ``max_body_bytes``: a larger body is a 413, refused before it is
    read whole or parsed; ``body_timeout_s``: a body slower than this is a 408;
    ``send_timeout_s``: a client that takes no piece of its response for this long is
    dropped (:mod:`.send_deadline`); ``public``: the server listens beyond loopback (a
    server without keys then keeps ``/fleet`` to itself); ``tools``: the tool-call parser
    (``--tool-call-parser``, ``--enable-auto-tool-choice``; default none);
    ``priority_header``: a header whose int is a request's priority (:mod:`.priority`)."""
    # (Not ``fleet`` and ``metrics``: the handlers of those names are registered below.)
    replicas, series = door.fleet, door.metrics
    intake = Intake(
        door.admission,
        replicas,
        door.tokenizer,
        door.run,
        served_model or replicas.model,
        door.loras,
        tools,
    )
    errors: Counter[str] = Counter()  # the HTTP layer's own (auth, slow clients, ...)
    door.add_error_counts(errors)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        door.start()
        freeze_startup_heap()
        try:
            yield
        finally:
            await door.close()
            intake.close()

    app = _App(title="kvroute", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.tenants, app.state.intake, app.state.fleet = tenants, intake, replicas
    app.state.door = door
    app.state.errors = errors
    # Streams keep their own send deadline (sse.py).
    app.state.responses = ResponseContext(door.tokenizer, series, errors, send_timeout_s)
    app.state.max_body_bytes, app.state.body_timeout_s = max_body_bytes, body_timeout_s
    app.state.public = public
    app.state.priority_header = priority_header

    def fleet_json() -> dict[str, Any]:  # /fleet
        stats = replicas.subscriber.stats()
        return fleet_view(replicas, door.policy.name, door.admission, stats)

    def metrics_text() -> bytes:  # /metrics; the subscriber's stats read on this loop
        return render_metrics(series, door.fleet_collector, replicas.subscriber.stats())

    app.state.fleet_view, app.state.metrics_text = fleet_json, metrics_text

    count_response = series.count_response

    def with_middleware(inner: ASGIApp) -> ASGIApp:
        """kvroute's middleware around ``inner`` (the send deadline inside the request id's: a
        dropped client is no internal error); the same on both paths (FastAPI's, direct)."""
        deadline = SendDeadlineMiddleware(
            inner, send_timeout_s, on_drop=lambda: errors.update(["slow_client"])
        )
        return RequestIdMiddleware(
            deadline,
            on_internal_error=lambda: errors.update(["internal"]),
            on_response=count_response,
        )

    app.add_middleware(with_middleware)  # type: ignore[arg-type]
    app.direct_endpoints = {
        "/v1/completions": _DirectEndpoint(completions, app.state, send_timeout_s, count_response),
        "/v1/chat/completions": _DirectEndpoint(
            chat_completions, app.state, send_timeout_s, count_response
        ),
        "/v1/responses": _DirectEndpoint(responses, app.state, send_timeout_s, count_response),
    }
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    schemas: dict[str, Any] = {}  # request bodies' sub-models, for /openapi.json

    def body_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
        """The body in the OpenAPI schema (the handlers read the body themselves)."""
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        content = {"application/json": {"schema": schema}}
        return {"requestBody": {"required": True, "content": content}}

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/fleet", fleet, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route(
        "/v1/completions",
        completions,
        methods=["POST"],
        openapi_extra=body_schema(CompletionRequest),
    )
    app.add_api_route(
        "/v1/chat/completions",
        chat_completions,
        methods=["POST"],
        openapi_extra=body_schema(ChatCompletionRequest),
    )
    app.add_api_route(
        "/v1/responses",
        responses,
        methods=["POST"],
        openapi_extra=body_schema(ResponsesRequest),
    )
    for path, handler, body in (
        ("/v1/load_lora_adapter", load_lora_adapter, LoadLoRAAdapterRequest),
        ("/v1/unload_lora_adapter", unload_lora_adapter, UnloadLoRAAdapterRequest),
    ):  # admin keys, checked by the handlers
        app.add_api_route(path, handler, methods=["POST"], openapi_extra=body_schema(body))
    for path, handler, body in (
        ("/tokenize", tokenize, TokenizeRequest),
        ("/detokenize", detokenize, DetokenizeRequest),
    ):
        app.add_api_route(
            path,
            handler,
            methods=["POST"],
            dependencies=[Depends(_authenticate)],
            openapi_extra=body_schema(body),
        )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = FastAPI.openapi(app)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    return app
