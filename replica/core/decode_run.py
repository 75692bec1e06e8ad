"""Runs of pure decode steps advanced at once: the simulator's fast path, on the scheduler's
own state (a mixin of :class:`~.scheduler.Scheduler`, kept apart because the engine never
uses it).

Why: most steps of a busy engine decode one token for every running request and change
nothing else. A simulator, which samples nothing and owns its clock, need not go through
them one by one: :meth:`DecodeRuns.decode_run_after` says how many such steps are certain,
and :meth:`DecodeRuns.advance_decode_run` applies them at once, leaving exactly the state
that step-by-step scheduling would (tests/replica/core/test_decode_run.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_pool import KVCacheBlock
    from .fair_queue import TenantUsage
    from .kv_cache_manager import KVCacheManager
    from .priority_queue import PriorityFairQueue
    from .request import Request, RequestStatus
    from .scheduler_types import SchedulerConfig, SchedulerOutput


class DecodeRuns:
    """Needs the scheduler's queues, usage counters and these of its helpers."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    block_size: int
    max_model_len: int
    running: list[Request]
    waiting: PriorityFairQueue[Request]
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

    def decode_run_after(self, output: SchedulerOutput) -> int:
        """How many steps after ``output`` (just scheduled, its tokens not yet applied) are
        bound to be the same batch, so that :meth:`advance_decode_run` may apply them at
        once after ``update_from_output(output)``; 0 when the next one is not.

        Such a run: ``output`` decodes one token for every running request, and so does each
        step of the run; each of its steps but the last allocates no block and fills none
        (:meth:`KVCacheManager.num_noop_steps`), so the pool, the hits and the free blocks
        stay as ``output`` left them; the last may fill or allocate a block per request when
        nobody waits and the free blocks suffice (what it changes is published at the run's
        end, as that step's would be); nobody waiting can be admitted
        (:meth:`_admission_blocked`); no request reaches its length limits before the run's
        last step; and no token can stop one (no EOS, or ignored, and no stop ids), so the
        run does not depend on what is sampled. The engine samples every step and never
        calls this; a simulator, which samples nothing and owns its clock, skips the
        per-step work."""
        running = self.running
        if output.preempted_request_ids or len(output.scheduled) != len(running):
            return 0
        steps = max_len = self.max_model_len
        for item, req in zip(output.scheduled, running, strict=True):
            if item.request is not req or item.num_new_tokens != 1 or not req.num_output_tokens:
                return 0  # a prompt chunk, a newcomer, a recompute
            if item.num_computed_tokens + 1 != item.num_tokens:
                return 0  # does not sample
            sp = req.sampling_params
            if sp.stop_token_ids or (req.eos_token_id is not None and not sp.ignore_eos):
                return 0
            # after output's token: num_output + 1 outputs, num_tokens + 1 tokens
            left = min(sp.max_tokens - req.num_output_tokens, max_len - len(req.all_token_ids))
            if left < steps:
                steps = left
        steps -= 1
        if steps <= 0:
            return 0
        kv = self.kv_cache_manager
        noop = kv.num_noop_steps(running)  # num_computed_tokens already counts output's
        if noop < steps and not self.waiting:
            # The next step may fill or allocate, as the run's last: its blocks must be free.
            bs, tables = self.block_size, kv.req_to_blocks
            need = sum(
                req.num_computed_tokens + noop + 1 > len(tables[req.request_id]) * bs
                for req in running
            )
            if need <= kv.get_num_free_blocks():
                noop += 1
        steps = min(steps, noop)
        return steps if steps > 0 and self._admission_blocked() else 0

    def _admission_blocked(self) -> bool:
        """Nobody waiting would be admitted in the next step, nor in the steps after it
        while the pool, the queues and the running set stay as they are (during a run of
        pure decode steps): the waiting loop of :meth:`_schedule` stops at once. (A block
        allocated or evicted can only keep it so: fewer free blocks, fewer hits.)"""
        cfg, kv = self.config, self.kv_cache_manager
        top = self.waiting.top_priority
        if top is not None and self.running and top < self.running[-1].priority:
            return False  # it may preempt a less urgent running request (.admission)
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
        """Applies ``num_steps`` steps of a run (at most :meth:`decode_run_after` said) at
        once, every running request sampling ``token_id`` in each: the state that as many
        :meth:`schedule` / :meth:`update_from_output` calls would leave (the last step's
        slots taken as schedule() takes them). Returns the requests that finished (at the
        run's last step)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.finished_req_ids = set()  # what the steps' schedule() calls would have taken
        running, kv = self.running, self.kv_cache_manager
        if num_steps > 1:
            tokens = [token_id] * (num_steps - 1)
            for req in running:
                req.num_computed_tokens += num_steps - 1
                req.append_output_tokens(tokens)
        bs = self.block_size
        for req in running:  # the last step: a block filled or allocated, at most
            # A token that neither starts a block nor fills one needs nothing of the cache
            # (the table holds ceil(computed / B) blocks): skip the call.
            if (req.num_computed_tokens + 1) % bs <= 1 and kv.allocate_slots(req, 1) is None:
                raise RuntimeError(f"decode run out of blocks at {req.request_id!r}")
            req.num_computed_tokens += 1
        charge, max_len = self.usage.charge, self.max_model_len
        ending: list[Request] = []
        for req in running:
            req.append_output_token(token_id)
            charge(req.tenant, num_steps)
            # No token stops anyone in a run (decode_run_after), only the length limits.
            if req.num_output_tokens >= req.sampling_params.max_tokens or (
                len(req.all_token_ids) >= max_len
            ):
                ending.append(req)
        finished = []
        for req in ending:
            status = self._check_stop(req)
            if status is not None:
                running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished
