"""From an HTTP request to a started :class:`RequestRun`: admit, read, validate, tokenize,
bound, route.

Why a class of its own: every step here is an edge check that must happen in order and
before any replica is touched -- admission before the body is even read (a refused
request costs a header lookup), the body cap before parsing, the model and unsupported
parameters before tokenizing, a cheap length bound before the tokenizer, the shared bounds
before routing -- and the heavy steps (parsing big bodies, chat templates, tokenization)
run on a worker thread, so one large request never stalls the event loop that serves
/health and every other tenant.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
import pydantic
from fastapi import Request

from kvroute.events.replica_api import (
    SEED_MIN,
    TOKEN_ID_MAX,
    BoundsError,
    InvalidRequestError,
    SamplingParams,
    StructuredOutputs,
    check_prompt_token_ids,
)

from .admission import OverloadedError, Ticket
from .errors import APIError, one_line, read_body, request_id, validation_error
from .frontdoor import FrontDoor
from .openai_api import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from .openai_wire import DECODERS, ChatBody, CompletionBody
from .policy import NoReplicaError
from .quarantine import QueryOfDeathError
from .request_run import REPLICA_FAILURES, RequestRun
from .response_format import structured_outputs
from .responses import FAILED, request_failed
from .tenants import Tenant

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # default cap on a request body, checked before it is parsed
BODY_TIMEOUT_S = 30.0  # default time for a body to arrive whole (a 408 past it)
# A token covers at most this many characters in the cheap bound applied before tokenizing
# (the tokenizer's longest vocabulary entry, when it can be read, replaces it).
DEFAULT_CHARS_PER_TOKEN = 32
OFF_LOOP_BODY_BYTES = 64 << 10  # bodies past this are parsed on the worker thread
M = TypeVar("M", bound=pydantic.BaseModel)
Body = CompletionRequest | ChatCompletionRequest | CompletionBody | ChatBody


class Intake:
    """One per app: the front door, the served model's name and the worker thread."""

    def __init__(
        self,
        door: FrontDoor,
        model_name: str,
        max_body_bytes: int,
        body_timeout_s: float | None = BODY_TIMEOUT_S,
    ) -> None:
        self.door = door
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        # One thread: a tokenizer is not safe to share between threads.
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvroute-tokenize")
        self.chars_per_token = _chars_per_token(door.tokenizer)
        self.encode = fast_encoder(door.tokenizer)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    async def parse(self, request: Request, model: type[M]) -> Any:
        """The body as ``model`` (or its msgspec twin, which behaves the same): read under
        the size cap, validated strictly, checked."""
        raw = await read_body(request, self.max_body_bytes, self.body_timeout_s)
        fast = DECODERS[model]

        def decode() -> Any:  # ``model``, or its twin (which behaves the same)
            try:
                raw.decode()  # msgspec skips unknown fields unread: UTF-8 checked whole here
                return fast(raw)  # the msgspec twin (openai_wire says why)
            except (ValueError, RecursionError):  # msgspec's errors, bad UTF-8, deep nesting
                return model.model_validate_json(raw)  # accepts, or says why not

        try:
            body = await self.off_loop(decode) if len(raw) > OFF_LOOP_BODY_BYTES else decode()
        except pydantic.ValidationError as exc:
            raise validation_error(list(exc.errors(include_url=False))) from None
        self._check(body)  # type: ignore[arg-type]
        return body

    def check_model(self, body: Any) -> None:
        """``body.model`` is the one served (set to it when the body names none)."""
        if body.model is None:
            body.model = self.model_name
        elif body.model not in (self.model_name, self.door.fleet.model):
            # 400 (vLLM answers 404): the body names what is served.
            raise APIError(
                400,
                f"The model `{body.model[:100]}` does not exist; this server serves "
                f"`{self.model_name}`.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def _check(self, body: Body) -> None:
        """The model (none named: the one served), then parameters this server does not
        implement."""
        self.check_model(body)
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

    def check_length(self, chars: int) -> None:
        """A cheap bound before tokenizing: so many characters cannot fit the context."""
        if chars > self.door.fleet.max_model_len * self.chars_per_token:
            raise APIError(
                400,
                f"The prompt is longer than this model's context of "
                f"{self.door.fleet.max_model_len} tokens can hold.",
                "invalid_request_error",
                "prompt",
                "context_length_exceeded",
            )

    def vocab(self) -> int | None:
        """The fleet's smallest vocabulary (None: no replica says)."""
        vocab = None
        for r in self.door.fleet.replicas.values():
            v = r.info.vocab_size
            if v and (vocab is None or v < vocab):
                vocab = v
        return vocab

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` (token ids as strings) as the engine's, every id checked
        against the vocabulary here: an id past it would fail the request on its replica."""
        if not bias:
            return None
        vocab = self.vocab()
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
        vocab = self.vocab()
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
            ids: list[int] = await self.off_loop(lambda: encode(prompt))
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

    async def chat_ids(self, request: Request, body: ChatCompletionRequest | ChatBody) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        self.check_length(sum(len(m["content"]) for m in messages))
        tokenizer = self.door.tokenizer

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return list(tokenizer(text, add_special_tokens=False).input_ids)

        try:
            ids: list[int] = await self.off_loop(render)
        except Exception as exc:  # no template, or the template rejects the roles
            log.warning("request %s: chat template failed", request_id(request), exc_info=True)
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
        max_len = self.door.fleet.max_model_len
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
                logprobs=body.num_logprobs(),
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

    async def begin(
        self, request: Request, tenant: Tenant, model: type[Body]
    ) -> tuple[Body, list[RequestRun]]:
        """Admits, reads and tokenizes the request, then routes and sends one run per
        choice (``n`` per prompt, prompt by prompt); every failure a status. Each run holds
        one admission ticket, taken before it is launched; on any failure the tickets no
        run holds are given back and the runs already sent are closed. No run's first delta
        is in yet: :meth:`first` waits for it (the caller gets its response ready
        meanwhile)."""
        tickets = [await self.admit(tenant)]
        runs: list[RequestRun] = []
        try:
            body = await self.parse(request, model)
            prompts = None if body.chat else self.prompts(body)  # type: ignore[arg-type]
            self._check_choices(body, 1 if prompts is None else len(prompts), tenant)
            if prompts is None:
                all_ids = [await self.chat_ids(request, body)]  # type: ignore[arg-type]
            else:
                all_ids = [await self.prompt_ids(p) for p in prompts]
            n = body.n or 1
            many = len(all_ids) * n > 1
            structured = structured_outputs(body)
            for ids in all_ids:
                spec = self.sampling(body, len(ids), structured)
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
                    index = len(runs) if many else None
                    runs.append(
                        self.launch(request, tenant, tickets[len(runs)], ids, body.cache_salt,
                                    choice_spec, index)
                    )  # fmt: skip
            return body, runs
        except BaseException:
            for ticket in tickets[len(runs) :]:
                self.door.admission.release(ticket)
            for run in runs:
                run.close()
            raise

    def _check_choices(self, body: Body, num_prompts: int, tenant: Tenant) -> None:
        """Several choices (a batch, ``n`` > 1) are served whole, not streamed; at most
        ``MAX_CHOICES`` of them, and no more than the tenant may ever run at once (a 429
        would tell its client to retry what can never be admitted)."""
        n = body.n or 1
        param = "n" if n > 1 else "prompt"
        if num_prompts * n > 1 and body.stream:
            raise APIError(
                400,
                f"`stream: true` serves one choice per request; this one asks for "
                f"{num_prompts * n} ({num_prompts} prompt(s) x n={n}): send it without "
                "`stream`, or as separate requests.",
                "invalid_request_error",
                param,
                "unsupported_parameter",
            )
        if num_prompts * n > MAX_CHOICES:
            raise APIError(
                400,
                f"{num_prompts} prompt(s) x n={n} is more than {MAX_CHOICES} choices.",
                "invalid_request_error",
                param,
            )
        cap = self.door.admission.concurrency_cap(tenant) if num_prompts * n > 1 else None
        if cap is not None and num_prompts * n > cap:
            raise APIError(
                400,
                f"{num_prompts} prompt(s) x n={n} choices run as {num_prompts * n} requests; "
                f"this tenant may run at most {cap} at once.",
                "invalid_request_error",
                param,
            )

    async def admit(self, tenant: Tenant) -> Ticket:
        """The tenant's and the router's budgets: a ticket, or a 429 with Retry-After."""
        try:
            return await self.door.admission.admit(tenant)
        except OverloadedError as exc:
            raise APIError(
                429, str(exc), "rate_limit_exceeded", code="rate_limit_exceeded",
                headers={"retry-after": exc.retry_after},
            ) from None  # fmt: skip

    def launch(
        self,
        request: Request,
        tenant: Tenant,
        ticket: Ticket,
        ids: list[int],
        salt: str | None,
        spec: SamplingParams,
        index: int | None = None,
    ) -> RequestRun:
        """Routes one choice and sends it; every failure a status. ``index``: the choice's
        place among several (its request id takes it as a suffix)."""
        rid = request_id(request)
        if index is not None:
            rid = f"{rid}-{index}"
        door = self.door
        door.admission.charge(ticket, len(ids))
        try:
            run = door.run(ticket, tenant, ids, spec, salt, request_id=rid)
        except QueryOfDeathError as exc:
            raise APIError(
                400, str(exc), "invalid_request_error", code="request_quarantined"
            ) from None
        try:
            run.submit()
        except BaseException as exc:
            run.close()
            raise _as_status(rid, exc) from None
        return run

    async def await_first_delta(self, request: Request, run: RequestRun) -> None:
        """Waits for the run's first delta, so that everything that can go wrong before it
        (a bad request, a dead replica) is settled while an HTTP status can still say so;
        every failure a status, the run closed."""
        rid = request_id(request)
        try:
            first = await run.first_delta()
            if first.finish_reason == "error":  # failed before its first token: a status
                raise request_failed(rid, first)
        except BaseException as exc:
            run.close()
            raise _as_status(rid, exc) from None


# A replica's refusal that names the request field at fault, as ``field: why``
_NAMED = re.compile(r"(?:request rejected: )?(structured_outputs|prompt_logprobs|prompt):")


def _as_status(rid: str, exc: BaseException) -> BaseException:
    """A failure before the first token as the status that says it (others unchanged)."""
    if isinstance(exc, InvalidRequestError):
        message = one_line(str(exc))
        named = _NAMED.match(message)  # the replica's "field: why", e.g. a bad constraint
        return APIError(400, message, "invalid_request_error", named and named.group(1))
    if isinstance(exc, NoReplicaError):
        return APIError(503, str(exc), "service_unavailable", headers={"retry-after": "1"})
    if isinstance(exc, REPLICA_FAILURES):
        log.warning("request %s: replica failed: %s", rid, one_line(str(exc)))
        suspect = getattr(exc, "suspect", False)
        msg = FAILED + (
            "; it was not retried elsewhere, as it may have caused the failure" if suspect else ""
        )
        return APIError(503, msg, "service_unavailable", code="replica_failed")
    return exc


def fast_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """A prompt's ids as ``tokenizer(text).input_ids`` gives them, from a fast tokenizer's
    Rust backend called directly when it gives the same ids (checked on probes here, once):
    no offsets computed, no ``BatchEncoding`` built, which is CPU the front door spends per
    request (BENCHMARKS.md, "Fronting vllm serve"). Otherwise the tokenizer itself."""

    def slow(text: str) -> list[int]:
        return list(tokenizer(text).input_ids)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return slow
    batch = getattr(backend, "encode_batch_fast", None)  # tokenizers >= 0.21: no offsets

    def fast(text: str) -> list[int]:
        if batch is not None:
            return list(batch([text])[0].ids)
        return list(backend.encode(text).ids)

    specials = "".join(getattr(tokenizer, "all_special_tokens", None) or ())
    probes = ["", "Hello, world!", "  two  spaces\n\nand lines\t", "ünïcödé 你好 🙂", specials,
              f"{specials} text between {specials}"]  # fmt: skip
    try:
        if all(fast(p) == slow(p) for p in probes):
            return fast
    except Exception:  # an odd backend: the tokenizer's own call is the reference
        log.debug("tokenizer backend not used directly", exc_info=True)
    return slow


def _chars_per_token(tokenizer: Any) -> int:
    """The most characters one token can stand for (its longest vocabulary entry)."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=0)
    except Exception:  # a stand-in tokenizer in tests
        return DEFAULT_CHARS_PER_TOKEN
    return max(longest, 1)
