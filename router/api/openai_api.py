"""OpenAI-compatible request and response models for the front door.

Why pydantic here (msgspec elsewhere): FastAPI's schemas and its users' expectations. Types
are strict, as OpenAI's are: ``"stream": "yes"``, ``"max_tokens": "5"``, ``"max_tokens":
true`` and string token ids are refused, not coerced. Ranges come from the bounds the engine
enforces (:mod:`kvroute.events.replica_api`), so a request the front door accepts is one no
engine stage will fail on. Unknown fields are ignored (as OpenAI and vLLM do, so SDKs that
send newer fields keep working), but the OpenAI parameters this server does not implement
are declared, so that setting one is refused by name (:meth:`_Request.unsupported`) instead
of being silently ignored. ``cache_salt``, ``top_k``, ``min_p``, ``ignore_eos``,
``min_tokens``, ``repetition_penalty`` and ``stop_token_ids`` are vLLM's extensions;
``usage.prompt_tokens_details.cached_tokens`` is OpenAI's field for the prompt tokens served
from cache.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kvroute.events.replica_api import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    TOKEN_ID_MAX,
    BoundsError,
    check_text,
)

from ..fleet.tenants import PRIORITY_MAX, PRIORITY_MIN


def _utf8(text: str) -> str:
    try:
        check_text(text, "text")
    except BoundsError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for the legacy completions' ``logprobs``
# Choices one request may ask for (prompts x ``n``): each is a request in flight, with its
# own admission ticket.
MAX_CHOICES = 64

# Parameters of OpenAI's API this server does not implement, with the values that ask for
# nothing (and so are accepted): anything else is a 400 naming the parameter.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "prompt_logprobs": (None,),  # vLLM's; ``echo`` with ``logprobs`` gives the prompt's
}


def _neutral(value: object, neutral: tuple[object, ...]) -> bool:
    """``value`` is one of ``neutral``, type included (``0`` is not ``False``)."""
    return any(value is n or (type(value) is type(n) and value == n) for n in neutral)


# The behaviour of a request body, shared by these pydantic models (the schema, OpenAPI, the
# error messages) and their msgspec twins in openai_wire (the hot path's decoder).
class RequestMethods:
    __slots__ = ()
    chat: ClassVar[bool] = False
    served: ClassVar[frozenset[str]] = frozenset({"best_of"})  # in UNSUPPORTED, served here
    if TYPE_CHECKING:  # declared by the classes that mix this in (an annotation here would
        model: str | None  # be taken for a field by msgspec, and override theirs)
        stream: bool | None
        stream_options: Any
        stop: str | list[str] | None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> str | None:
        """The first OpenAI parameter set that this server does not implement, or None
        (every one of them defaults to None, so "set" is "not None")."""
        for name, neutral in UNSUPPORTED.items():
            if name in self.served:
                continue
            value = getattr(self, name, None)
            if value is not None and not _neutral(value, neutral):
                return name
        return None


class CompletionMethods(RequestMethods):
    __slots__ = ()
    if TYPE_CHECKING:
        logprobs: int | None

    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine should report (None: no logprobs)."""
        return self.logprobs


class ChatMethods(RequestMethods):
    __slots__ = ()
    chat: ClassVar[bool] = True
    served: ClassVar[frozenset[str]] = frozenset({"best_of", "tools", "tool_choice"})
    if TYPE_CHECKING:
        logprobs: bool | None
        top_logprobs: int | None

    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine should report (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatMessageMethods:
    __slots__ = ()
    if TYPE_CHECKING:
        role: str
        content: Any
        name: str | None

    def text(self) -> str:
        """The message's text (parts joined); non-text parts are refused before this."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text or "" for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it, for a message without tool calls or a
        call id (those: :func:`~.agents.tools.template_messages`, which parses calls)."""
        if self.name is None:
            return {"role": self.role, "content": self.text()}
        return {"role": self.role, "content": self.text(), "name": self.name}

    def non_text_part(self) -> tuple[int, str] | None:
        """(index, type) of the first part that is not text (an image, audio, a file)."""
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    return i, part.type
        return None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _Request(_Strict, RequestMethods):
    model: Text | None = None  # None: the served model (vLLM's default; OpenAI requires it)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None: 1
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # None: 1
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension; 0 or -1: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM extension; 0: off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=256)  # vLLM
    # vLLM's: lower runs first; checked against the tenant's range (router/api/priority.py)
    priority: int | None = Field(default=None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    ignore_eos: bool | None = False  # vLLM extension
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM extension
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    # OpenAI's: token ids (as JSON object keys, strings) to biases added to their logits.
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
            Field(max_length=MAX_LOGIT_BIAS_TOKENS),
        ]
        | None
    ) = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # choices per prompt
    # OpenAI's and vLLM's output constraints, free-form here: router/api/agents/response_format.py
    # reads them (a 400 naming the field when malformed).
    response_format: Any = None
    structured_outputs: Any = None
    # Candidates per prompt to return the ``n`` likeliest of (router/api/choices/respond.py)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    # Declared only to be refused by name when set (see UNSUPPORTED); never used.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    prompt_logprobs: Any = None


class CompletionRequest(_Request, CompletionMethods):
    # Text, or token ids; or a list of either, a batch (LangChain's completions LLM sends
    # even one prompt so): each prompt gets ``n`` choices, indexed prompt by prompt.
    prompt: (
        Text
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # OpenAI's default for completions; 0 only with ``echo`` (the prompt alone, as vLLM)
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool | None = None  # the prompt ahead of the completion, its logprobs too
    suffix: Text | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)


class ContentPart(_Strict):
    """A part of a message's content; only ``text`` parts can be served by a text model."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Text
    text: Text | None = None


class HistoryFunction(_Strict):
    name: Text
    arguments: Text  # JSON text, as the model's answer gave it


class HistoryToolCall(_Strict):
    """A call an assistant message made earlier in the chat (the answer's ``tool_calls``)."""

    id: Text
    type: Literal["function"] = "function"
    function: HistoryFunction


class ChatMessage(_Strict, ChatMessageMethods):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[HistoryToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_Request, ChatMethods):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    parallel_tool_calls: bool | None = None


class PromptTokensDetails(BaseModel):
    """``cached_tokens`` is OpenAI's; kvroute adds ``cached_tokens_by_tier`` (tokens loaded
    from a replica's host "CPU" or disk "STORAGE" KV tier; the rest of ``cached_tokens``
    were device hits) only when a lower tier served some, so the usual body is OpenAI's."""

    model_config = ConfigDict(extra="allow")
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(
    prompt: int, completion: int, cached: int, by_tier: dict[str, int] | None = None
) -> Usage:
    details = (
        PromptTokensDetails(cached_tokens=cached, cached_tokens_by_tier=by_tier)
        if by_tier
        else PromptTokensDetails(cached_tokens=cached)
    )
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


def usage_of(last: Any) -> Usage | None:
    """The usage a request's last delta reports (None: no last delta)."""
    if last is None:
        return None
    return make_usage(
        last.num_prompt_tokens,
        last.num_output_tokens,
        last.num_cached_tokens,
        getattr(last, "num_tier_cached_tokens", None),
    )


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (with ``echo``, the
    prompt's first, whose first token has null entries: nothing precedes it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # OpenAI's shape: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


def make_choice(
    chat: bool,
    index: int,
    text: str | None,
    finish: str | None,
    logprobs: Any,
    tool_calls: list[dict[str, Any]] | None = None,
) -> Any:
    """One choice of a whole (not streamed) answer, in the endpoint's shape."""
    if chat:
        msg = ChatDelta(role="assistant", content=text, tool_calls=tool_calls or None)
        return ChatChoice(index=index, message=msg, finish_reason=finish, logprobs=logprobs)
    return CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=logprobs)


def make_response(
    chat: bool, response_id: str, model: str, choices: list[Any], usage: Any
) -> dict[str, Any]:
    """A whole answer's body, in the endpoint's shape."""
    shape = ChatCompletionResponse if chat else CompletionResponse
    return shape(id=response_id, model=model, choices=choices, usage=usage).model_dump()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvroute"
    # vLLM's field: where the weights and tokenizer were loaded from (a path on the server).
    # `vllm bench serve` with no --model loads its tokenizer from it (and fails without it).
    root: str | None = None
    max_model_len: int | None = None  # the context: prompt + max_tokens must fit in it
    vocab_size: int | None = None  # prompt token ids must be below it (None: not known)
    # vLLM's field for a LoRA adapter: the base model it applies to (None: a base model).
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None
    request_id: str | None = None  # finds the full trace in the server's log


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str,
    type_: str,
    status: int,
    param: str | None = None,
    code: str | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI sends it (``code`` defaults to the HTTP status)."""
    info = ErrorInfo(
        message=message,
        type=type_,
        param=param,
        code=code or str(status),
        request_id=request_id,
    )
    return ErrorResponse(error=info).model_dump()


def dumps(obj: Any) -> str:
    """JSON for error bodies and SSE lines: ASCII only, so text a client sent back to it (a
    lone surrogate in ``model``) can always be encoded."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)
