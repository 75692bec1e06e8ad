"""From a request's body to its started runs: admit, parse, validate, tokenize, bound,
route -- with no HTTP in sight.

Why a class of its own: every step here is an edge check that must happen in order and
before any replica is touched -- admission before the body is even read (a refused
request costs a header lookup), the model and unsupported parameters before tokenizing, a
cheap length bound before the tokenizer, the shared bounds before routing -- and the
heavy steps (parsing big bodies, chat templates, tokenization) run on a worker thread, so
one large request never stalls the event loop that serves /health and every other tenant.

Why no FastAPI ``Request``: :meth:`Intake.begin` takes the body (bytes, or a coroutine
that reads them once the request is admitted: :mod:`.app` reads it under its cap and
deadline), the tenant and the request id, so a request can go through intake -- in a
test, a benchmark, another server -- without an HTTP server. Its parts are handed in:
admission, the fleet's facts (:class:`Served`), the tokenizer, the front door's
:meth:`~.frontdoor.FrontDoor.run`. A feature's module (:mod:`.priority`,
:mod:`.choices.count`, :mod:`.agents.tools`, :mod:`.agents.response_format`) is called
only by a request that uses the feature. Waiting for the first delta is :mod:`.responses`'.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
import pydantic

from kvroute.events.replica_api import (
    SEED_MIN,
    TOKEN_ID_MAX,
    BoundsError,
    SamplingParams,
    StructuredOutputs,
    check_prompt_token_ids,
)

from ..fleet.admission import Admission, OverloadedError, Ticket
from ..fleet.quarantine import QueryOfDeathError
from ..fleet.request_run import RequestRun
from ..fleet.tenants import Tenant
from ..lora.registry import Adapter, not_found
from .agents.response_format import structured_outputs
from .agents.tool_parsers import make_parser
from .agents.tool_template import template_for
from .agents.tools import ToolConfig, ToolPlan, plan_tools, special_markers, template_messages
from .choices.count import check_choices, ranked, runs_per_prompt
from .encode import chars_per_token
from .errors import APIError, one_line, status_of
from .openai_api import ChatCompletionRequest, CompletionRequest
from .openai_wire import ChatBody, CompletionBody, decode_body
from .priority import DoorHints, RequestClass, classify
from .segment_cache import SegmentEncoder
from .text_cache import TextEncoder
from .worker import Worker

__all__ = ["Admitted", "Intake", "ranked", "runs_per_prompt"]

log = logging.getLogger(__name__)

OFF_LOOP_BODY_BYTES = 64 << 10  # bodies past this are parsed on the worker thread
# A text prompt with at most this many characters to tokenize afresh (:mod:`.text_cache`)
# is tokenized on the loop while the worker is idle (:mod:`.worker`): ~0.2 ms at most.
INLINE_TOKENIZE_CHARS = 1024
M = TypeVar("M", bound=pydantic.BaseModel)
Body = CompletionRequest | ChatCompletionRequest | CompletionBody | ChatBody
ReadBody = Callable[[], Awaitable[bytes]]  # the body, read once the request is admitted


class Served(Protocol):
    """What intake needs to know of the fleet (:class:`~.fleet.Fleet` is one)."""

    model: str
    max_model_len: int

    def vocab_size(self) -> int | None: ...


class StartRun(Protocol):
    """The front door's :meth:`~.frontdoor.FrontDoor.run`: a routed request, not yet sent."""

    def __call__(
        self,
        ticket: Ticket,
        tenant: Tenant,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_salt: str | None = None,
        request_id: str | None = None,
        lora: Adapter | None = None,
        priority: int = 0,
    ) -> RequestRun: ...


class Adapters(Protocol):
    """The fleet's LoRA adapters as intake asks about them (:class:`~.lora.LoRARegistry`)."""

    def resolve(self, model: str, tenant: Tenant) -> Adapter | None: ...


@dataclass(slots=True)
class Admitted:
    """A request through intake: its body, one run per choice (each sent, no first delta
    in yet: :mod:`.responses` waits for it), and the prompts as the body gave them (one
    per ``n`` runs; None for a chat)."""

    body: Body
    runs: list[RequestRun]
    prompts: list[Any] | None
    tools: ToolPlan | None = None  # a chat's tools: how its answer is read (:mod:`.tools`)


class Intake:
    """One per app: admission, the fleet's facts, the tokenizer and its worker thread."""

    def __init__(
        self,
        admission: Admission,
        served: Served,
        tokenizer: Any,
        start_run: StartRun,
        model_name: str,
        adapters: Adapters | None = None,
        tools: ToolConfig | None = None,
    ) -> None:
        """``model_name``: what clients call the served model (the fleet's own name is
        accepted too); ``adapters``: the LoRA adapters ``model`` may name instead;
        ``tools``: the tool-call parser flags (default: none, so ``auto`` is refused)."""
        self.tools = tools or ToolConfig()
        parser = make_parser(self.tools.parser, tokenizer) if self.tools.parser else None
        self.tool_markers = special_markers(tokenizer, parser) if parser else None
        self.adapters = adapters
        self.admission = admission
        self.served = served
        self.tokenizer = tokenizer
        self.start_run = start_run
        self.model_name = model_name
        # One thread: a tokenizer is not safe to share between threads (:mod:`.worker`).
        self.worker = Worker("kvroute-tokenize")
        self.chars_per_token = chars_per_token(tokenizer)
        # A text prompt's stretches seen before, kept: a shared prefix is tokenized once.
        self.encode = TextEncoder(tokenizer)
        # A chat's pieces between its template's markers, kept: a turn tokenizes its news.
        self.encode_chat = SegmentEncoder(tokenizer)

    def close(self) -> None:
        self.worker.close()

    @property
    def max_model_len(self) -> int:
        return self.served.max_model_len

    async def off_loop(self, fn: Callable[[], Any]) -> Any:
        return await self.worker.run(fn)

    async def parse(self, raw: bytes, model: type[M], tenant: Tenant | None = None) -> Any:
        """The body as ``model`` (:func:`~.openai_wire.decode_body`; a large one on the
        worker thread), checked (``tenant``: whose adapters ``model`` may name)."""
        body, _ = await self.parse_with_adapter(raw, model, tenant)
        return body

    async def parse_with_adapter(
        self, raw: bytes, model: type[M], tenant: Tenant | None
    ) -> tuple[Any, Adapter | None]:
        """:meth:`parse`, and the adapter the body's ``model`` names (None: the base)."""
        if len(raw) > OFF_LOOP_BODY_BYTES:
            body = await self.off_loop(lambda: decode_body(raw, model))
        else:
            body = decode_body(raw, model)
        return body, self._check(body, tenant)

    def check_model(self, body: Any, tenant: Tenant | None = None) -> Adapter | None:
        """``body.model`` is the base model (set to it when the body names none; None
        returned) or an adapter ``tenant`` may use (returned). Anything else is vLLM's 404,
        the same whether the adapter does not exist or the tenant may not use it."""
        if body.model is None:
            body.model = self.model_name
            return None
        if body.model in (self.model_name, self.served.model):
            return None
        adapter = None
        if tenant is not None and self.adapters is not None:
            adapter = self.adapters.resolve(body.model, tenant)
        if adapter is None:
            raise not_found(body.model)
        return adapter

    def _check(self, body: Body, tenant: Tenant | None) -> Adapter | None:
        """The model (none named: the one served; else maybe an adapter, returned), then
        parameters this server does not implement."""
        adapter = self.check_model(body, tenant)
        param = body.unsupported()
        if param is not None:
            raise APIError(
                400,
                f"`{param}` is not supported by this server.",
                "invalid_request_error",
                param,
                "unsupported_parameter",
            )
        if not body.chat and body.max_tokens == 0 and not body.echo:  # type: ignore[union-attr]
            raise APIError(
                400,
                "`max_tokens` must be at least 1, or 0 with `echo: true` (the prompt alone).",
                "invalid_request_error",
                "max_tokens",
            )
        if body.chat:
            if body.top_logprobs and not body.logprobs:
                raise APIError(
                    400,
                    "`top_logprobs` needs `logprobs: true`.",
                    "invalid_request_error",
                    "top_logprobs",
                )
            for i, m in enumerate(body.messages):
                bad = m.non_text_part()
                if bad is not None and bad[1] == "text":
                    raise APIError(
                        400,
                        "A `text` content part needs a `text` string.",
                        "invalid_request_error",
                        f"messages.{i}.content.{bad[0]}.text",
                    )
                if bad is not None:
                    raise APIError(
                        400,
                        f"Content parts of type `{one_line(bad[1])[:40]}` are not supported "
                        "(a text model is served); send `text` parts.",
                        "invalid_request_error",
                        f"messages.{i}.content.{bad[0]}",
                        "unsupported_parameter",
                    )
        return adapter

    def check_length(self, chars: int) -> None:
        """A cheap bound before tokenizing: so many characters cannot fit the context."""
        if chars > self.served.max_model_len * self.chars_per_token:
            raise APIError(
                400,
                f"The prompt is longer than this model's context of "
                f"{self.served.max_model_len} tokens can hold.",
                "invalid_request_error",
                "prompt",
                "context_length_exceeded",
            )

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` (token ids as strings) as the engine's, every id checked
        against the vocabulary here: an id past it would fail the request on its replica."""
        if not bias:
            return None
        vocab = self.served.vocab_size()
        out: dict[int, float] = {}
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()) or (vocab is not None and int(key) >= vocab):
                raise APIError(
                    400,
                    f"logit_bias: {key[:20]!r} is not a token id of this model "
                    f"(a decimal string{f' below {vocab}' if vocab else ''})",
                    "invalid_request_error",
                    "logit_bias",
                )
            out[int(key)] = float(value)
        return out

    def check_ids(self, ids: list[int], validated: bool = False, param: str = "prompt") -> None:
        """The shared bound on prompt ids (below the smallest vocabulary). ``validated``:
        ``ids`` came through the body's schema (a non-empty list of plain ints in ``[0,
        TOKEN_ID_MAX]``), so one ``max`` in C settles the usual case; anything else, or an
        id past the vocabulary, takes the full check, which names the culprit."""
        vocab = self.served.vocab_size()
        if validated and ids and max(ids) < (TOKEN_ID_MAX + 1 if vocab is None else vocab):
            return
        try:
            check_prompt_token_ids(ids, vocab, param)
        except BoundsError as exc:
            raise APIError(400, str(exc), "invalid_request_error", exc.param) from None

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """One prompt's token ids: text tokenized off the loop, ids checked."""
        if isinstance(prompt, str):
            self.check_length(len(prompt))
            encode = self.encode
            got = encode.cheap(prompt, INLINE_TOKENIZE_CHARS) if self.worker.idle() else None
            ids: list[int] = got if got is not None else await self.off_loop(lambda: encode(prompt))
            self.check_ids(ids)
        else:
            ids = list(prompt)
            self.check_ids(ids, validated=True)
        return ids

    @staticmethod
    def prompts(body: CompletionRequest | CompletionBody) -> list[Any]:
        """The body's prompts: one, or each of a batch (a list of texts or of id lists)."""
        prompt = body.prompt
        if prompt and not isinstance(prompt, str) and not isinstance(prompt[0], int):
            return list(prompt)
        return [prompt]

    async def chat_ids(
        self, body: ChatCompletionRequest | ChatBody, rid: str, tools: ToolPlan | None = None
    ) -> list[int]:
        """The chat's messages through the model's template (with ``tools``' tools, and
        their calls and results: :mod:`.tools`), tokenized off the loop."""
        msgs = body.messages
        tool_list = tools.tools if tools is not None else None
        if any(m.tool_calls or m.tool_call_id is not None for m in msgs):
            messages = template_messages(msgs)  # calls' arguments parsed (:mod:`.agents.tools`)
        else:
            messages = [m.template_dict() for m in msgs]
        with_tools = bool(tool_list) or any(m.role == "tool" or m.tool_calls for m in msgs)
        chars = sum(len(m["content"]) for m in messages)
        self.check_length(chars + (len(str(tool_list)) if tool_list else 0))
        tokenizer = self.tokenizer
        template = template_for(tokenizer, with_tools) if with_tools else None
        kw: dict[str, Any] = {} if template is None else {"chat_template": template}
        if tool_list:
            kw["tools"] = tool_list

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kw
            )
            return self.encode_chat(text)

        try:
            ids: list[int] = await self.off_loop(render)
        except Exception as exc:  # no template, or the template rejects the roles
            log.warning("request %s: chat template failed", rid, exc_info=True)
            raise APIError(
                400, f"cannot render chat: {one_line(str(exc))}", "invalid_request_error"
            ) from None
        self.check_ids(ids)
        return ids

    def sampling(
        self, body: Body, n_prompt: int, structured: StructuredOutputs | None = None
    ) -> SamplingParams:
        """The request's sampling as the engine will check it (the shared bounds);
        ``structured``: its output constraint (:func:`.response_format.structured_outputs`)."""
        max_len = self.served.max_model_len
        room = max_len - n_prompt
        max_tokens = body.max_tokens
        prompt_logprobs = None
        if body.chat:
            max_tokens = body.max_completion_tokens or max_tokens  # type: ignore[union-attr]
        elif body.echo:  # type: ignore[union-attr]
            prompt_logprobs = body.logprobs  # type: ignore[union-attr]
            if max_tokens == 0:  # the prompt alone: one token is made and dropped (vLLM's way)
                max_tokens = 1
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens; the prompt has "
                f"{n_prompt} tokens and max_tokens is {max_tokens}.",
                "invalid_request_error",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens or room,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(body.top_k or 0, 0),
                min_p=body.min_p or 0.0,
                seed=body.seed,
                stop=body.stop_list(),
                stop_token_ids=list(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                min_tokens=body.min_tokens or 0,
                logprobs=self._logprobs(body),
                prompt_logprobs=prompt_logprobs,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if body.repetition_penalty is None else body.repetition_penalty
                ),
                logit_bias=self._logit_bias(body.logit_bias),
                structured_outputs=structured,
            )
        except BoundsError as exc:
            raise APIError(400, str(exc), "invalid_request_error", exc.param) from None

    @staticmethod
    def _logprobs(body: Body) -> int | None:
        """Alternatives per token the engine reports: the request's, or 0 (the sampled
        token's alone) when ``best_of`` ranks its candidates by them."""
        top = body.num_logprobs()
        return 0 if top is None and body.best_of is not None and ranked(body) else top

    async def begin(
        self,
        tenant: Tenant,
        model: type[Body],
        body: bytes | ReadBody,
        rid: str,
        hints: DoorHints | None = None,
    ) -> Admitted:
        """Admits the request, then reads (``body``), parses and tokenizes it, then routes
        and sends one run per choice (``n`` per prompt, prompt by prompt); every failure an
        :class:`APIError`. ``rid``: the request's id (its runs' ids, its log lines). Each run
        holds one admission ticket, taken before it is launched; on any failure the tickets
        no run holds are given back and the runs already sent are closed. ``hints``: the
        headers' priority and deadline (:mod:`.priority`)."""
        tickets = [await self.admit(tenant)]
        runs: list[RequestRun] = []
        try:
            raw = body if isinstance(body, bytes) else await body()
            parsed, adapter = await self.parse_with_adapter(raw, model, tenant)
            priority = getattr(parsed, "priority", None)
            klass = None
            if hints is not None or priority is not None or tenant.priority:
                klass = classify(priority, hints, tenant)
            prompts = None if parsed.chat else self.prompts(parsed)
            one = parsed.best_of is None and (parsed.n or 1) == 1
            if not (one and prompts is None):  # a feature's module only where it is used
                n_prompts = 1 if prompts is None else len(prompts)
                check_choices(parsed, n_prompts, tenant, self.admission)
            plan = None
            if parsed.chat and (parsed.tools or parsed.tool_choice is not None):
                plan = plan_tools(parsed, self.tools, self.tokenizer, self.tool_markers)
            if prompts is None:
                all_ids = [await self.chat_ids(parsed, rid, plan)]
            else:
                all_ids = [await self.prompt_ids(p) for p in prompts]
            n = 1 if one else runs_per_prompt(parsed)
            many = len(all_ids) * n > 1
            structured = plan.structured() if plan is not None else None
            if structured is None and (
                getattr(parsed, "structured_outputs", None) is not None
                or getattr(parsed, "response_format", None) is not None
            ):
                structured = structured_outputs(parsed)
            for ids in all_ids:
                spec = self.sampling(parsed, len(ids), structured)
                for sample in range(n):
                    if len(tickets) <= len(runs):
                        tickets.append(await self.admit(tenant))
                    # A prompt's n seeded choices: seeds offset by place, so they differ
                    # (as vLLM's do). Unseeded ones share one spec (nothing mutates it).
                    if sample and spec.seed is not None:
                        seed = (spec.seed + sample - SEED_MIN) % 2**64 + SEED_MIN
                        choice_spec = msgspec.structs.replace(spec, seed=seed)
                    else:
                        choice_spec = spec
                    choice_id = f"{rid}-{len(runs)}" if many else rid
                    runs.append(
                        self.launch(tenant, tickets[len(runs)], ids, parsed.cache_salt,
                                    choice_spec, choice_id, adapter, klass)
                    )  # fmt: skip
            return Admitted(parsed, runs, prompts, plan)
        except BaseException:
            for ticket in tickets[len(runs) :]:
                self.admission.release(ticket)
            for run in runs:
                run.close()
            raise

    async def admit(self, tenant: Tenant) -> Ticket:
        """The tenant's and the router's budgets: a ticket, or a 429 with Retry-After."""
        try:
            return await self.admission.admit(tenant)
        except OverloadedError as exc:
            raise APIError(
                429, str(exc), "rate_limit_exceeded", code="rate_limit_exceeded",
                headers={"retry-after": exc.retry_after},
            ) from None  # fmt: skip

    def launch(
        self,
        tenant: Tenant,
        ticket: Ticket,
        ids: list[int],
        salt: str | None,
        spec: SamplingParams,
        rid: str,
        adapter: Adapter | None = None,
        klass: RequestClass | None = None,
    ) -> RequestRun:
        """Routes one choice (request id ``rid``; ``adapter``: its LoRA adapter, None for
        the base model; ``klass``: its priority and deadline) and sends it, or queues it
        at the door (flow control); every failure a status."""
        self.admission.charge(ticket, len(ids))
        klass = klass or RequestClass()
        kw: dict[str, Any] = {"priority": klass.priority} if klass.priority else {}
        try:
            if adapter is None:
                run = self.start_run(ticket, tenant, ids, spec, salt, request_id=rid, **kw)
            else:
                run = self.start_run(
                    ticket, tenant, ids, spec, salt, request_id=rid, lora=adapter, **kw
                )
        except QueryOfDeathError as exc:
            raise APIError(
                400, str(exc), "invalid_request_error", code="request_quarantined"
            ) from None
        try:
            run.submit(klass.deadline) if klass.deadline is not None else run.submit()
        except BaseException as exc:
            run.close()
            raise status_of(rid, exc) from None
        return run
