"""Messages between a router and a replica actor, as msgspec Structs, and the one call
that streams a request from an actor.

Why here (``events``) and not in ``replica``: like the KV events, these are the contract
between the two sides, and ``router`` never imports ``replica``. Conversions to and from
the engine's own types live in :mod:`kvroute.replica.actor`.

Why Structs and not dataclasses: they pickle (Ray's transport) and encode to msgpack or JSON
(any other transport, logs) with the same schema, and they are cheap to build per token.
This module imports neither torch nor transformers, only msgspec and (for
:func:`stream_generate`) ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import ray

from .bounds import (  # the shared request bounds, part of this contract
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    TOKEN_ID_MAX,
    BoundsError,
    check_prompt_token_ids,
    check_sampling,
    check_text,
)
from .hashing import HashConfig
from .load import CostCoefficients

__all__ = [
    "MAX_LOGPROBS",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "SEED_MAX",
    "SEED_MIN",
    "TOKEN_ID_MAX",
    "BoundsError",
    "GenerateDelta",
    "GenerateRequest",
    "InvalidRequestError",
    "ReplicaDeadError",
    "ReplicaInfo",
    "Resume",
    "SamplingParams",
    "check_prompt_token_ids",
    "check_sampling",
    "check_text",
    "stream_generate",
]


class InvalidRequestError(ValueError):
    """The request can never run on this replica (too long, bad parameters): a 4xx, not a
    reason to retry elsewhere. Raised by the actor in place of the engine's own errors, so
    a caller can catch it without importing the engine."""


class ReplicaDeadError(RuntimeError):
    """The replica's engine failed; the actor is exiting so Ray can restart it.

    ``suspect``: the request was in the engine step that failed (or that step's batch is not
    known), so it may be a query of death -- replaying it elsewhere could kill that replica
    too. A request that was not (queued, or sent to an engine already dead) can be retried
    on another replica. Tokens already streamed are not undone either way."""

    def __init__(self, message: str, *, suspect: bool = True) -> None:
        super().__init__(message)
        self.suspect = suspect

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray: keep the flag
        return (_replica_dead, (str(self), self.suspect))


def _replica_dead(message: str, suspect: bool) -> ReplicaDeadError:
    return ReplicaDeadError(message, suspect=suspect)


class ReplicaInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a router must know to use a replica and to follow its event stream.

    ``incarnation`` changes every time the actor process starts: a router that sees a new
    one knows the replica restarted (new endpoints, empty cache, event seq from 0).
    """

    replica_id: str
    model: str  # as configured: a built-in name or a path
    model_path: str  # the local Hugging Face folder the engine loaded
    hash_algo: str
    hash_seed: str
    hash_form: str  # "bytes" | "int": how block hashes appear in events
    block_size: int
    num_blocks: int
    max_model_len: int
    events_endpoint: str  # PUB socket, as reachable from other nodes
    replay_endpoint: str | None  # ROUTER socket for replay and snapshots
    topic: str
    node_ip: str
    pid: int
    incarnation: str
    restarted: bool  # Ray reconstructed this actor (max_restarts)
    vocab_size: int | None = None  # prompt token ids must be below it (None: not reported)
    cost: CostCoefficients | None = None  # its step-time model: routers price it in it
    node_id: str | None = None  # the Ray node it runs on (several nodes may share an IP)

    @property
    def hash_config(self) -> HashConfig:
        """Compare with the router's own :class:`HashConfig` (``mismatch``) before routing."""
        return HashConfig(self.hash_algo, self.hash_seed, self.block_size)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick each next token and when to stop (vLLM's names) -- the one type: the
    front door builds it, it crosses Ray inside :class:`GenerateRequest`, and the engine
    runs on it. Checked by :func:`check_sampling` (the bounds the front door enforces too)
    when built and again when decoded, so the scheduler and sampler never meet a
    nonsensical value (a negative ``max_tokens`` would only surface as a request that never
    finishes, a seed past int64 as a sampler that raises).

    ``temperature == 0`` means greedy. ``top_k == 0`` (or vLLM's ``-1``, normalised to 0)
    disables top-k. ``min_tokens`` suppresses EOS and ``stop_token_ids`` until that many
    tokens were generated (``max_tokens`` still applies). ``stop`` strings are matched by
    the engine on detokenised text; the scheduler only handles token-level stops.
    ``logprobs``: how many top logprobs to return per token (None: none).
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        check_sampling(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


class Resume(msgspec.Struct, kw_only=True, frozen=True):
    """A request continued on another replica after its first one failed mid-stream: the
    tokens it had generated there, and how many characters of their text the client already
    has. The engine goes on as if it had generated them itself: same stop checks, same
    held-back text, and a seeded request's generator past the draws of those tokens."""

    output_token_ids: list[int]
    sent_chars: int = 0


class GenerateRequest(msgspec.Struct, kw_only=True):
    """One request, already tokenized by the router (which hashed the same tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    cache_salt: str | None = None
    resume: Resume | None = None  # a failover: continue from these outputs
    tenant: str | None = None  # whose request: the engine's queue takes tenants in turn


class GenerateDelta(msgspec.Struct, kw_only=True):
    """What one engine step added to a request; the last one has ``finished`` set."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    error: str | None = None  # with "error": the request's own stage that failed, one line
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # cumulative
    logprobs: list[dict[int, float]] | None = None  # one entry per token of this delta
    # First delta only: seconds from the replica receiving the request to this delta (its
    # queueing and prefill). A front door subtracts it from its own TTFT: what it added.
    replica_ttft_s: float | None = None


async def stream_generate(actor: Any, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
    """Streams a request from a replica actor; cancels it remotely if the consumer stops
    early (break, task cancelled, generator closed), which frees its blocks at once.

    Ray 2.60 does not cancel a streaming task whose ``ObjectRefGenerator`` is merely
    dropped, so this ``ray.cancel``s it on any early exit. This contract's own errors
    (:class:`InvalidRequestError`, :class:`ReplicaDeadError`) are raised as themselves, not
    wrapped in Ray's ``RayTaskError``, whose text is a remote traceback (pids, addresses)
    that must never reach a client."""
    gen = actor.generate.options(num_returns="streaming").remote(req)
    ended = False  # the remote task is over: nothing to cancel
    try:
        async for ref in gen:
            try:
                delta: GenerateDelta = await ref
            except asyncio.CancelledError:
                raise
            except ray.exceptions.RayTaskError as exc:  # the stream's own error: its last item
                ended = True
                cause = getattr(exc, "cause", None)
                if isinstance(cause, InvalidRequestError | ReplicaDeadError):
                    raise cause from None
                raise
            except Exception:
                ended = True
                raise
            yield delta
        ended = True
    finally:
        if not ended:
            ray.cancel(gen)
