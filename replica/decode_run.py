"""Runs of pure decode steps advanced at once: the simulator's fast path, on the scheduler's
own state (a mixin of :class:`~.scheduler.Scheduler`, kept apart because the engine never
uses it).

Why: most steps of a busy engine decode one token for every running request and change
nothing else. A simulator, which samples nothing and owns its clock, need not go through
them one by one: :meth:`DecodeRuns.decode_run_length` says how many such steps are certain,
and :meth:`DecodeRuns.advance_decode_run` applies them at once, leaving exactly the state
that step-by-step scheduling would (tests/replica/test_decode_run.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_pool import KVCacheBlock
    from .fair_queue import FairQueue, TenantUsage
    from .kv_cache_manager import KVCacheManager
    from .request import Request, RequestStatus
    from .scheduler import SchedulerConfig


class DecodeRuns:
    """Needs the scheduler's queues, usage counters and these of its helpers."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    block_size: int
    max_model_len: int
    running: list[Request]
    waiting: FairQueue[Request]
    usage: TenantUsage
    finished_req_ids: set[str]

    if TYPE_CHECKING:

        def _prefill_shares(
            self, partial: dict[str | None, int] | None
        ) -> dict[str | None, int] | None: ...
        def _partial_prefills(self) -> dict[str | None, int] | None: ...
        def _first_chunk(
            self, req: Request, budget: int
        ) -> tuple[list[KVCacheBlock], int, int]: ...
        def _check_stop(self, req: Request) -> RequestStatus | None: ...
        def _finish(self, req: Request, status: RequestStatus) -> None: ...

    def decode_run_length(self, min_steps: int = 1) -> int:
        """How many next steps are bound to be the same pure-decode batch, so that
        :meth:`advance_decode_run` may apply them at once; 0 when the next one is not, or
        when fewer than ``min_steps`` are (a caller with no use for shorter runs skips the
        admission check).

        Such a run: every running request decodes one token and gets it (the budget holds
        them all); no block is allocated or filled (:meth:`KVCacheManager.num_noop_steps`),
        so the pool, the hits and the free blocks stay as they are; nobody waiting can be
        admitted (:meth:`_admission_blocked`), and with the pool unchanged nobody becomes
        admissible; no request reaches its length limits before the run's last step; and
        no token can stop one (no EOS, or ignored, and no stop ids), so the run does not
        depend on what is sampled. The engine samples every step and never calls this; a
        simulator, which samples nothing and owns its clock, skips the per-step work."""
        running = self.running
        if not running or len(running) > self.config.max_num_batched_tokens:
            return 0
        steps = max_len = self.max_model_len
        for req in running:
            num_tokens, num_output = len(req.all_token_ids), len(req.output_token_ids)
            if num_tokens - req.num_computed_tokens != 1 or not num_output:
                return 0  # a prompt (or recompute) chunk to go
            sp = req.sampling_params
            if sp.stop_token_ids or (req.eos_token_id is not None and not sp.ignore_eos):
                return 0
            left = min(sp.max_tokens - num_output, max_len - num_tokens)
            if left < steps:
                steps = left
        if steps < min_steps:
            return 0
        steps = min(steps, self.kv_cache_manager.num_noop_steps(running))
        return steps if steps >= max(min_steps, 1) and self._admission_blocked() else 0

    def _admission_blocked(self) -> bool:
        """Nobody waiting would be admitted in the next step, nor in the steps after it
        while the pool, the queues and the running set stay as they are (during a run of
        pure decode steps): the waiting loop of :meth:`_schedule` stops at once."""
        cfg, kv = self.config, self.kv_cache_manager
        budget = cfg.max_num_batched_tokens - len(self.running)
        if not self.waiting or budget <= 0 or len(self.running) >= cfg.max_num_seqs:
            return True
        free = kv.get_num_free_blocks()
        if free == 0:
            return True
        req = self.waiting.peek()
        if free >= -(-req.num_tokens // self.block_size):
            return False  # the head fits whatever it hits: no need for the lookup
        # With shares, the order of tenants follows the usage counts, which every step
        # changes: no promise. Without, only the head is tried, and it fits or not alike in
        # every step (no partial prefills are running, so their limit does not bind).
        if self._prefill_shares(self._partial_prefills()) is not None:
            return False
        hit_blocks, _, num_new = self._first_chunk(req, budget)
        return not num_new or not kv.can_allocate(req, num_new, hit_blocks)

    def advance_decode_run(self, num_steps: int, token_id: int = 0) -> list[Request]:
        """Applies ``num_steps`` steps of a run (at most :meth:`decode_run_length`) at once,
        every running request sampling ``token_id`` in each: the state that as many
        :meth:`schedule` / :meth:`update_from_output` calls would leave. Returns the requests
        that finished (at the run's last step)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.finished_req_ids = set()  # what the steps' schedule() calls would have taken
        tokens = [token_id] * num_steps
        charge, max_len = self.usage.charge, self.max_model_len
        ending: list[Request] = []
        for req in self.running:
            req.num_computed_tokens += num_steps
            req.append_output_tokens(tokens)
            charge(req.tenant, num_steps)
            # No token stops anyone in a run (decode_run_length), only the length limits.
            if req.num_output_tokens >= req.sampling_params.max_tokens or (
                len(req.all_token_ids) >= max_len
            ):
                ending.append(req)
        finished = []
        for req in ending:
            status = self._check_stop(req)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished
