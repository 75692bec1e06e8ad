"""Who computes a step's prompt tokens when tenants compete: the scheduler's fair shares
(moved out of :mod:`.scheduler`, which mixes :class:`PrefillShares` in).

Why: a step lasts as long as all its tokens take, so a short request that shares a step with
another tenant's long prompt chunk waits for that chunk. While tenants compete, a step's
prompt tokens are bounded and the least-served tenant (:class:`~.fair_queue.TenantUsage`)
takes its need first. Shares are fairness within one priority level: while the prompt work
pending spans several levels, priority alone decides (no shares), so an urgent prompt is
never capped to make room for a less urgent tenant's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .fair_queue import TenantUsage
    from .kv_cache_manager import KVCacheManager
    from .priority_queue import PriorityFairQueue
    from .request import Request
    from .scheduler_types import SchedulerConfig


class PrefillShares:
    """Needs the scheduler's queues, usage counters and its adapter check."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    block_size: int
    running: list[Request]
    waiting: PriorityFairQueue[Request]
    usage: TenantUsage

    if TYPE_CHECKING:

        def _running_loras(self) -> set[str]: ...
        def _lora_admits(self, req: Request, loras: set[str]) -> bool: ...

    def _prefill_shares(
        self, partial: dict[str | None, int] | None
    ) -> dict[str | None, int] | None:
        """Prompt tokens each tenant may compute this step, when two or more have some to
        compute (None otherwise: one tenant, or none, schedules as before; or the pending
        prompts are of several priority levels).

        While tenants compete, a step computes at most ``long_prefill_token_threshold``
        prompt tokens (or, without one, the smallest pending need per competing tenant), and
        the least-served tenant takes its need first; never fewer than
        ``min_prefill_share_tokens``, what a step costs anyway. A newcomer's short prompt thus
        gets a step of about its own length; the long prompt goes on at full size as soon
        as nobody else waits, and catches up in turn when it is the least served. Decodes
        are never capped."""
        if not self.config.enable_chunked_prefill or self.usage.num_live_tenants < 2:
            return None  # a capped prompt would be a chunk; or nobody to compete with
        pending: dict[str | None, int] = {}
        levels: set[int] = set()
        for req in self.running:
            left = req.num_tokens - req.num_computed_tokens
            if left > 1:
                pending[req.tenant] = pending.get(req.tenant, 0) + left
                levels.add(req.priority)
        heads = self.waiting.heads() if len(self.running) < self.config.max_num_seqs else []
        if len(pending.keys() | {req.tenant for req in heads}) < 2:
            return None  # one tenant at most: no prefix lookups for nothing
        for req in heads:  # only those that could be admitted now
            need = self._admissible_need(req, partial)
            if need:
                pending[req.tenant] = pending.get(req.tenant, 0) + need
                levels.add(req.priority)
        if len(pending) < 2 or len(levels) > 1:
            return None
        cap = self.config.long_prefill_token_threshold or max(
            min(pending.values()) * len(pending), self.config.min_prefill_share_tokens
        )
        shares: dict[str | None, int] = {}
        # Ties (a newcomer is lifted to the least count) go to the tenant with less in the
        # engine, then to the smaller need.
        order = sorted(pending, key=lambda t: (self.usage.count(t), self.usage.live(t), pending[t]))
        for tenant in order:
            shares[tenant] = min(pending[tenant], cap)
            cap -= shares[tenant]
        return shares

    def _admissible_need(self, req: Request, partial: dict[str | None, int] | None) -> int:
        """Prompt tokens a waiting request would compute, 0 when it could not be admitted
        this step (its first chunk's blocks are not free, or its tenant has enough prompts
        part-way): a share reserved for it would only hold the others back."""
        kv, cfg = self.kv_cache_manager, self.config
        if cfg.max_loras and not self._lora_admits(req, self._running_loras()):
            return 0
        num_hit = kv.peek_cached_tokens(req)
        need = req.num_tokens - num_hit
        chunk = min(need, cfg.chunk_limit(num_hit) or need, cfg.max_num_batched_tokens)
        # Conservative: its cached blocks may sit in the free queue too, and come out of it.
        if -(-(num_hit + chunk) // self.block_size) > kv.get_num_free_blocks():
            return 0
        limit = cfg.max_num_partial_prefills
        at_limit = partial is not None and partial.get(req.tenant, 0) >= limit
        return 0 if chunk < need and at_limit else need

    def _partial_prefills(self) -> dict[str | None, int] | None:
        """Running requests part-way through their prompt, per tenant (None: no limit)."""
        cfg = self.config
        if not (cfg.max_num_partial_prefills and cfg.enable_chunked_prefill):
            return None
        partial: dict[str | None, int] = {}
        for req in self.running:
            if req.num_tokens - req.num_computed_tokens > 1:
                partial[req.tenant] = partial.get(req.tenant, 0) + 1
        return partial


def within_share(shares: dict[str | None, int] | None, req: Request, num_new: int) -> int:
    """``num_new`` capped by what is left of the request's tenant's prefill share (decodes,
    and every request when no shares apply, are never capped)."""
    if shares is None or num_new <= 1:
        return num_new
    return min(num_new, shares.get(req.tenant, num_new))


def charge_share(shares: dict[str | None, int] | None, req: Request, num_new: int) -> None:
    if shares is not None and num_new > 1:
        shares[req.tenant] = shares.get(req.tenant, num_new) - num_new
