"""The scheduler's limits and one step's decisions: what the runner, the engine, the cost
model and the simulator read, apart from the scheduling code (:mod:`.scheduler`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .request import Request


class RequestTooLongError(ValueError):
    """The request can never run here: longer than max_model_len or the whole KV cache."""


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_num_seqs: int = 128
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # >0: cap one request's prefill chunk per step, so one long prompt cannot take the whole
    # budget from other prefills (only with chunked prefill).
    long_prefill_token_threshold: int = 0
    # >0: at most this many requests of one tenant may be part-way through their prompt at
    # once (vLLM's max_num_partial_prefills, counted per tenant; with one tenant the same):
    # with the threshold above it bounds the prompt tokens of any step, so a newcomer waits
    # behind one short step, not several chunks at once (only with chunked prefill).
    max_num_partial_prefills: int = 0
    # What one (query, key) pair of attention costs in prompt tokens' dense work (the cost
    # model's attention_s_per_pair / prefill_s_per_token). >0: the threshold above bounds a
    # chunk's cost, not its length: a chunk deep in a long prompt attends to more, so it is
    # shorter, and a step of it lasts no longer than ``threshold`` tokens at a prompt's
    # start. 0: plain tokens (vLLM's meaning).
    attention_weight: float = 0.0
    # The fewest prompt tokens a step shared between tenants may compute (0: no floor):
    # those whose dense work takes as long as a step's fixed cost (the cost model's
    # overhead and one read of the weights, :func:`~.cost_model.fair_share_floor`). The fair
    # share caps a step's prompt tokens by the smallest need among the tenants competing;
    # below this floor the cap only multiplies steps, each paying the fixed cost again.
    min_prefill_share_tokens: int = 0
    # >0: LoRA adapters are served, at most this many distinct ones among the running
    # requests (the engine's device slots; vLLM's max_loras). A waiting request whose
    # adapter would exceed it, or is not in memory yet, is passed over, not waited for.
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2 (one prompt token, one output)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_num_partial_prefills < 0:
            raise ValueError("max_num_partial_prefills must be >= 0")
        if self.attention_weight < 0:
            raise ValueError("attention_weight must be >= 0")
        if self.min_prefill_share_tokens < 0:
            raise ValueError("min_prefill_share_tokens must be >= 0")
        if self.max_loras < 0:
            raise ValueError("max_loras must be >= 0")

    def chunk_limit(self, num_computed: int) -> int:
        """The most prompt tokens one request may compute in a step from position
        ``num_computed`` (0: no limit). Solves ``n + w * (n * p0 + n * (n + 1) / 2) <= T + w
        * T * (T + 1) / 2`` for ``n``: the cost of ``T = threshold`` tokens from position 0."""
        t, w = self.long_prefill_token_threshold, self.attention_weight
        if not (t and self.enable_chunked_prefill):
            return 0
        if w <= 0.0 or num_computed <= 0:
            return t
        budget = t + w * t * (t + 1) / 2
        b = 1.0 + w * (num_computed + 0.5)
        n = int((math.sqrt(b * b + 2.0 * w * budget) - b) / w)

        def cost(k: int) -> float:
            return k + w * (k * num_computed + k * (k + 1) / 2)

        if cost(n + 1) <= budget:  # the root, rounded either way
            n += 1
        elif n > 1 and cost(n) > budget:
            n -= 1
        return max(1, n)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner feeds ``request.all_token_ids[num_computed_tokens : num_computed_tokens +
    num_new_tokens]`` at those positions, writing their KV into ``block_ids`` (the whole
    block table; position p lives in block ``block_ids[p // block_size]``).
    """

    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    block_ids: list[int]
    # The request's length when scheduled; the default (-1) reads it from the request.
    num_tokens: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = self.request.num_tokens

    @property
    def samples(self) -> bool:
        """This step reaches the end of the known tokens: the runner samples one token."""
        return self.num_computed_tokens + self.num_new_tokens >= self.num_tokens


@dataclass
class SchedulerOutput:
    # running first, then newly admitted; with priorities, the newly admitted more urgent
    # than some running requests come before those
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str]
    finished_request_ids: list[str]  # finished or aborted since the last step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
