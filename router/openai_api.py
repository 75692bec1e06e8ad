"""OpenAI-compatible request and response models for the front door.

Why pydantic here (msgspec elsewhere): FastAPI validates request bodies with pydantic, and
its errors become the OpenAI-style 400s clients expect. Unknown request fields are ignored
(as OpenAI and vLLM do), so SDKs that send newer fields keep working. ``cache_salt`` is
vLLM's extension; ``usage.prompt_tokens_details.cached_tokens`` is OpenAI's field for the
prompt tokens served from cache (the engine's ``num_cached_tokens``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM extension; 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request (n > 1 is not served)
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Request):
    prompt: str | list[int]  # text, or token ids (one prompt per request)
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Text parts joined; other part types (images) are not served by a text model."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvroute"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str, type_: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI sends it (``code`` defaults to the HTTP status)."""
    info = ErrorInfo(message=message, type=type_, param=param, code=code or str(status))
    return ErrorResponse(error=info).model_dump()
