"""One generation request as the scheduler tracks it (vLLM v1's ``Request``, trimmed).

Prompt and generated tokens live in one growing list, ``all_token_ids``, because that is
what the KV cache covers: prefix hashing, recompute after preemption and the model runner
all treat a generated token exactly like a prompt token.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

from kvroute.events.kv_transfer import KVSource
from kvroute.events.replica_api import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle; every value above ``PREEMPTED`` is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # this request's own data failed a stage; others run on
    # Its prompt done here, its decode goes on on another replica (a P/D handoff): its
    # prompt blocks are leased to that replica (:mod:`..kv_transfer.leases`).
    FINISHED_HANDOFF = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > _PREEMPTED


_PREEMPTED = RequestStatus.PREEMPTED  # read per request per step: a class lookup costs more
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_HANDOFF: "handoff",
}


class Request:
    """A request's tokens and progress; satisfies ``kv_cache_manager.CacheRequest``.

    ``num_computed_tokens`` counts tokens whose KV is in the cache *as scheduled*: the
    scheduler advances it when it schedules a chunk, before the runner computes it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        arrival_time: float | None = None,
        output_token_ids: Sequence[int] = (),
        tenant: str | None = None,
        kv_handoff: bool = False,
        kv_source: KVSource | None = None,
        priority: int = 0,
    ) -> None:
        """``kv_handoff``: ends after its first token here (``FINISHED_HANDOFF``), its
        prompt blocks leased for the replica that decodes it. ``kv_source``: its prompt was
        computed on another replica, which holds the blocks for it to pull.
        ``output_token_ids``: tokens generated elsewhere before (a failover's resume).
        ``tenant``: whose request it is; the scheduler takes tenants in turn. ``lora_name``:
        its LoRA adapter (None: the base model), from the folder ``lora_path``.
        ``priority``: vLLM's meaning, lower runs first (default 0, negative allowed); the
        scheduler admits by it before tenants' turns and may preempt for it."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.tenant = tenant
        self.priority = priority
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.arrival_time = time.time() if arrival_time is None else arrival_time

        self._init_tokens(prompt_token_ids, output_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-hit tokens at first scheduling
        # Of those, the tokens a load brought from a lower tier, by medium ("CPU",
        # "STORAGE"); the rest were device hits. kv_load_tried: a load was started (once
        # per admission: a preemption clears it).
        self.tier_cached_tokens: dict[str, int] = {}
        self.kv_load_tried = False
        self.kv_handoff = kv_handoff
        self.kv_source = kv_source  # cleared once its pull starts, or is given up
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string
        self.error: str | None = None  # why it ended with FINISHED_ERROR (one line)
        # When asked: the prompt tokens' logprobs as the runner computes them, chunk by
        # chunk; entry i is token i's, given the tokens before it (None for the first).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if self.sampling_params.prompt_logprobs is not None else None
        )
        # Its structured-output matcher (an xgrammar GrammarMatcher), set by the engine.
        self.grammar: Any = None

    # -- tokens ------------------------------------------------------------------------
    def _init_tokens(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
    ) -> None:
        """Lists of ints here; the simulator's requests keep arrays (4 bytes a token)."""
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids: list[int] = [*self.prompt_token_ids, *output_token_ids]
        # A second list rather than a slice of all_token_ids: read every step, O(1) here.
        self._output_token_ids: list[int] = list(output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens so far. The scheduler's list: do not mutate."""
        return self._output_token_ids

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A request that wants its prompt's logprobs computes every prompt token (a cached
        one has no logits); its blocks are still cached for others (vLLM v1's rule)."""
        return self.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self._output_token_ids.append(token_id)

    def append_output_tokens(self, token_ids: Sequence[int]) -> None:
        """Several steps' tokens at once (a run of decode steps advanced in bulk)."""
        self.all_token_ids.extend(token_ids)
        self._output_token_ids.extend(token_ids)

    # -- status ------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status > _PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
