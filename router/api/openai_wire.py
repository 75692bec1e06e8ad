"""The request bodies as msgspec Structs: the hot path's decoder.

Why twins of :mod:`.openai_api`'s pydantic models: pydantic's strict JSON validation was a
large share of the front door's CPU per request, and msgspec decodes the same body for a
fraction of it (``benchmarks/bench_hot_lane.py``; BENCHMARKS.md). The pydantic models stay
the schema (OpenAPI, the hostile-input tests) and
the voice of every 400: a body these Structs refuse is handed to pydantic, which then
accepts it (an edge where msgspec is the stricter) or raises its usual error. So these
Structs may refuse more than the models, never less, and must decode what they accept to
the same values: ``tests/router/api/test_openai_wire.py`` checks both on generated bodies, and
that each model's fields are declared here.

Text needs no validator here: msgspec refuses a lone surrogate, escaped or raw, in every
field it decodes, where the models' ``_utf8`` check refuses it after parsing. Fields it does
not declare it skips unread, so :func:`decode_body` checks the whole body's UTF-8 first,
and falls back to pydantic on a ``RecursionError`` (nesting msgspec cannot follow). Two
differences remain, both in values nothing reads: msgspec accepts nesting between
pydantic's limit (~200) and its own (~990), and integers of over ~4,300 digits, in unknown
fields and in the ``Any`` fields declared only to be refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import pydantic
from msgspec import Meta

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
)

from ..fleet.tenants import PRIORITY_MAX, PRIORITY_MIN
from .errors import validation_error
from .openai_api import (
    MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS,
    ChatCompletionRequest,
    ChatMessageMethods,
    ChatMethods,
    CompletionMethods,
    CompletionRequest,
)

StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Meta(ge=0, le=TOKEN_ID_MAX)]
PositiveInt = Annotated[int, Meta(ge=1)]
M = TypeVar("M", bound=pydantic.BaseModel)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class _Request(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Meta(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    priority: Annotated[int, Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)] | None = None
    ignore_eos: bool | None = False
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY)] | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
            Meta(max_length=MAX_LOGIT_BIAS_TOKENS),
        ]
        | None
    ) = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    best_of: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    prompt_logprobs: Any = None
    structured_outputs: Any = None


class CompletionBody(CompletionMethods, _Request, kw_only=True):
    prompt: str | Annotated[list[TokenId], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=0)] | None = 16
    echo: bool | None = None
    suffix: str | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class HistoryFunction(msgspec.Struct):
    name: str
    arguments: str


class HistoryToolCall(msgspec.Struct):
    id: str
    function: HistoryFunction
    type: Literal["function"] = "function"


class ChatMessage(ChatMessageMethods, msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None


class ChatBody(ChatMethods, _Request, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    parallel_tool_calls: bool | None = None


# The pydantic model each Struct stands in for.
TWINS: dict[type, type[msgspec.Struct]] = {
    CompletionRequest: CompletionBody,
    ChatCompletionRequest: ChatBody,
}
DECODERS: dict[type, Callable[[bytes], Any]] = {
    model: msgspec.json.Decoder(twin).decode for model, twin in TWINS.items()
}


def decode_body(raw: bytes, model: type[M]) -> Any:
    """``raw`` as ``model``'s twin (which behaves the same), or as ``model`` where the twin
    refuses it; a body ``model`` refuses too is a 400 naming the field
    (:class:`~.errors.APIError`)."""
    try:
        try:
            raw.decode()  # msgspec skips unknown fields unread: UTF-8 checked whole here
            return DECODERS[model](raw)
        except (ValueError, RecursionError):  # msgspec's errors, bad UTF-8, deep nesting
            return model.model_validate_json(raw)  # accepts, or says why not
    except pydantic.ValidationError as exc:
        raise validation_error(list(exc.errors(include_url=False))) from None
