"""Messages between a front door and a replica, as msgspec Structs, and the errors a
request can end with.

Why here (``events``) and not in ``replica``: like the KV events, these are the contract
between the two sides, and ``router`` never imports ``replica``. How they travel is
:mod:`.dataplane_wire` (ZeroMQ); Ray carries only :class:`ReplicaInfo` (discovery) and control.

Why Structs and not dataclasses: they encode to msgpack (the data plane) or JSON (logs)
with one schema, pickle (Ray) too, and they are cheap to build per token. This module
imports neither torch, transformers nor ray: only msgspec.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from .bounds import (  # the shared request bounds, part of this contract
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
    check_prompt_token_ids,
    check_sampling,
    check_structured,
    check_text,
)
from .hashing import HashConfig
from .kv_transfer import KVHandoff, KVSource
from .load import CostCoefficients

__all__ = [
    "JSON_OBJECT_SCHEMA",
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_TOKENS",
    "MAX_LOGPROBS",
    "MAX_PENALTY",
    "MAX_REPETITION_PENALTY",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "SEED_MAX",
    "SEED_MIN",
    "TOKEN_ID_MAX",
    "BoundsError",
    "DeltaCounts",
    "GenerateDelta",
    "GenerateRequest",
    "InvalidRequestError",
    "ReplicaDeadError",
    "ReplicaInfo",
    "ReplicaLostError",
    "Resume",
    "SamplingParams",
    "StructuredOutputs",
    "check_prompt_token_ids",
    "check_sampling",
    "check_text",
    "delta_error",
    "merge_deltas",
    "next_delta",
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


class ReplicaLostError(RuntimeError):
    """The replica's process went away (its data-plane connection dropped, it fell silent,
    or Ray reports it dead) with no word from its engine about which request it died of.

    ``maybe_cause``: this request is the one the front door holds answerable -- the most
    recently sent of those in flight there, the likeliest to have been in the step that
    crashed (a query of death mostly kills in its first, prefill step); exactly one request
    per lost process is, so a crash that is some request's doing is never replayed onto
    every replica in turn. ``alone``: it was the only request in flight there."""

    def __init__(self, message: str, *, maybe_cause: bool = False, alone: bool = False) -> None:
        super().__init__(message)
        self.maybe_cause = maybe_cause
        self.alone = alone


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
    data_endpoint: str  # ROUTER socket of the data plane (requests in, outputs out)
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
    # Prompts longer than this hash with hashing.regime_salt (a rotary that switches
    # regime there: longrope); None: no switch.
    long_prompt_after: int | None = None
    # Draining (``kvroute scale`` retires it): routers send it nothing new, and what runs
    # there ends before the actor does.
    draining: bool = False
    # P/D (events.kv_transfer): "prefill" replicas compute prompts and hand their decode
    # off, "decode" replicas take handed-off requests, "both" do whole requests (and either
    # part). kv_transfer_endpoint: where other replicas pull its leased blocks (None: it
    # serves none).
    role: str = "both"
    kv_transfer_endpoint: str | None = None

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
    ``prompt_logprobs``: the same for every prompt token after the first, each given the
    tokens before it (vLLM's; OpenAI's ``echo`` with ``logprobs``). Such a request reads
    nothing from the prefix cache: a cached token has no logits to report.
    Penalties, as vLLM applies them to the logits before anything else: ``repetition_penalty``
    divides a positive logit (multiplies a negative one) of every token in the prompt or the
    output so far; ``frequency_penalty`` subtracts itself once per time a token was output,
    ``presence_penalty`` once for any token output at all (OpenAI's definitions).
    ``logit_bias`` adds to the logits of the token ids it names, before the penalties (as
    in vLLM). ``structured_outputs`` constrains the tokens to a schema, regex, choice or
    grammar (see :class:`StructuredOutputs`).
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off; else drop tokens below min_p x the likeliest's probability
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None

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

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must change this request's logits (bias or penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias) or (
            self.repetition_penalty != 1.0
        )


# ``json_object``: any JSON object (OpenAI's JSON mode), compiled as this schema
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class StructuredOutputs(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A constraint on what a request may generate (vLLM's ``StructuredOutputsParams``, its
    names): exactly one of a JSON schema (as text), any JSON object, a regular expression,
    one of ``choice``, or an EBNF ``grammar``. The replica compiles it against its own
    tokenizer and masks every step's logits with it; ``disable_any_whitespace`` keeps JSON
    compact (a small model can otherwise emit whitespace until ``max_tokens``)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        check_structured(self)


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
    lora_name: str | None = None  # the replica's LoRA adapter to serve it with (None: base)
    # P/D (events.kv_transfer): prefill here and end after the first token with a lease on
    # the prompt's blocks (``kv_handoff``); or pull the prompt's blocks from ``kv_source``.
    kv_handoff: bool = False
    kv_source: KVSource | None = None
    # vLLM's meaning: lower runs first, 0 by default, negative allowed. The front door sets
    # it from the tenant's configuration and the request (router/fleet/tenants.py); the
    # engine's scheduler admits, and may preempt, by it.
    priority: int = 0


class GenerateDelta(msgspec.Struct, kw_only=True, array_like=True):
    """What one engine step added to a request; the last one has ``finished`` set.

    Array-like on the wire (no field names): one step's message holds one per request."""

    request_id: str
    delta_token_ids: list[int]
    delta_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "handoff"
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    error: str | None = None  # with "error": the request's own stage that failed, one line
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0  # cumulative
    logprobs: list[dict[int, float]] | None = None  # one entry per token of this delta
    # First delta only: seconds from the replica receiving the request to this delta (its
    # queueing and prefill). A front door subtracts it from its own TTFT: what it added.
    replica_ttft_s: float | None = None
    # Set when the request did not end by itself: "invalid" (it can never run here: a 4xx,
    # ``error`` says why), "dead" (the engine failed; the request was not in the failing
    # step) or "suspect" (it was, or that step's batch is unknown: maybe a query of death).
    failure: str | None = None
    # With the first output token, when asked (``SamplingParams.prompt_logprobs``): one
    # entry per prompt token, None for the first (nothing precedes it), each holding the
    # prompt token's logprob and the top alternatives. Last, so that a shorter array (from
    # a replica one version older) still decodes.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Of ``num_cached_tokens``, those loaded from a lower KV tier, by medium ("CPU": host
    # memory, "STORAGE": local disk); the rest were device hits. None: none were. Last, for
    # the same reason as the field above.
    num_tier_cached_tokens: dict[str, int] | None = None
    # With finish_reason "handoff" (a ``kv_handoff`` request): the lease on its prompt
    # blocks, for the replica that decodes it. Last, as above.
    kv_handoff: KVHandoff | None = None


class DeltaCounts(Protocol):
    """A request relayed from another engine's stream (a vLLM replica's ``AsyncLLM``, a
    fronted ``vllm serve``), as :func:`next_delta` counts it."""

    request_id: str
    num_prompt: int
    num_output: int  # generated so far, resumed tokens included
    pending_text: str  # a resumed request's text the client has not had yet


def next_delta(
    req: DeltaCounts, ids: list[int], text: str, reason: str | None, error: str | None = None
) -> GenerateDelta:
    """The request's next GenerateDelta: ``ids`` counted into ``req.num_output``, the text
    held back (``req.pending_text``) first; a ``reason`` finishes it."""
    req.num_output += len(ids)
    if req.pending_text:
        text, req.pending_text = req.pending_text + text, ""
    return GenerateDelta(
        request_id=req.request_id,
        delta_token_ids=ids,
        delta_text=text,
        finished=reason is not None,
        finish_reason=reason,
        error=error,
        num_prompt_tokens=req.num_prompt,
        num_output_tokens=req.num_output,
    )


def merge_deltas(first: GenerateDelta, then: GenerateDelta) -> GenerateDelta:
    """Two consecutive deltas of one request as one: the later state, both increments.
    A reader that fell behind gets fewer, larger deltas instead of a growing backlog."""
    lp = None
    if first.logprobs is not None or then.logprobs is not None:
        lp = [*(first.logprobs or ()), *(then.logprobs or ())]
    return msgspec.structs.replace(
        then,
        delta_token_ids=first.delta_token_ids + then.delta_token_ids,
        delta_text=first.delta_text + then.delta_text,
        logprobs=lp,
        replica_ttft_s=first.replica_ttft_s
        if first.replica_ttft_s is not None
        else then.replica_ttft_s,
        prompt_logprobs=first.prompt_logprobs
        if first.prompt_logprobs is not None
        else then.prompt_logprobs,
    )


def delta_error(delta: GenerateDelta, replica_id: str) -> Exception | None:
    """The exception a delta's ``failure`` stands for (None: it ended by itself)."""
    if delta.failure is None:
        return None
    if delta.failure == "invalid":
        return InvalidRequestError(delta.error or "request rejected")
    why = delta.error or "engine failed"
    return ReplicaDeadError(f"replica {replica_id}: {why}", suspect=delta.failure != "dead")
