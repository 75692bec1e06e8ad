"""What the engine hands back per request and step: vLLM's output shapes, kept small."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence so far. ``text`` and ``token_ids`` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob, ...}
    error: str | None = None  # with finish_reason "error": what failed, one line

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after one engine step; ``delta_*`` is what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SampledToken:
    """A token and, when asked, its log-probability and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class RequestFailure:
    """One request's own fault inside a step's shared work; the engine fails that request."""

    stage: str  # "sampling", "seed", "logprobs", ...
    error: Exception
