"""What the engine hands back per request and step: vLLM's output shapes, kept small."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvroute.events.kv_transfer import KVHandoff
from kvroute.events.replica_api import GenerateDelta

if TYPE_CHECKING:
    from .request import Request


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence so far. ``text`` and ``token_ids`` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "handoff"
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
    # Of those, the ones loaded from a lower KV tier, by medium ("CPU", "STORAGE")
    num_tier_cached_tokens: dict[str, int] = field(default_factory=dict)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # When asked: entry i is prompt token i's ``{token id: logprob}`` given the tokens
    # before it, the top alternatives included; None for the first token (as vLLM's).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With finish_reason "handoff": the lease on its prompt blocks, for the replica that
    # decodes it (events.kv_transfer).
    kv_handoff: KVHandoff | None = None


# What a step hands back for one request: a RequestOutput (offline, asyncio callers) or, for
# a request added with ``deltas=True`` (the data plane), the wire's GenerateDelta directly.
EngineOutput = RequestOutput | GenerateDelta


def request_output(
    req: Request,
    prompt: str | None,
    text: str,
    new_ids: list[int],
    delta: str,
    logprobs: list[dict[int, float]] | None,
    stop_reason: int | str | None,
) -> RequestOutput:
    """``req`` after a step: its whole ``text`` and tokens so far, ``new_ids`` and ``delta``
    what this step added."""
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=list(req.output_token_ids),
        finish_reason=req.finish_reason,
        stop_reason=stop_reason,
        logprobs=logprobs,
        error=req.error,
    )
    return RequestOutput(
        request_id=req.request_id,
        prompt=prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[completion],
        finished=req.is_finished,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_tier_cached_tokens=dict(req.tier_cached_tokens),
        delta_text=delta,
        delta_token_ids=list(new_ids),
        prompt_logprobs=req.prompt_logprobs,
    )


def step_delta(
    req: Request,
    new_ids: list[int],
    text: str,
    logprobs: list[dict[int, float]] | None,
    stop_reason: int | str | None,
) -> GenerateDelta:
    """What one step added to ``req`` (``new_ids``, their ``text``), as the data plane sends
    it. ``logprobs``: all of the request's so far (this delta's are the last), or None.
    The prompt's logprobs, when asked, go with the first output token."""
    n_out = len(req.output_token_ids)
    return GenerateDelta(
        request_id=req.request_id,
        delta_token_ids=new_ids,
        delta_text=text,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        stop_reason=stop_reason,
        error=req.error,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_output_tokens=n_out,
        logprobs=None if logprobs is None else logprobs[n_out - len(new_ids) : n_out],
        prompt_logprobs=req.prompt_logprobs if new_ids and n_out == len(new_ids) else None,
        num_tier_cached_tokens=dict(req.tier_cached_tokens) if req.tier_cached_tokens else None,
    )


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
