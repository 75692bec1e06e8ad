"""Admitting waiting requests: by priority, then tenants in turn; preempting less urgent
running requests for more urgent ones (vLLM's ``--scheduling-policy priority``). The
:class:`~.scheduler.Scheduler` mixes :class:`Admission` in; its step loop calls
:meth:`Admission._admit` before the first running request less urgent than the most
urgent waiting one, and once after the running requests for everyone else.

The rules, and why:

- Only a strictly more urgent request preempts, and only for a batch slot
  (``max_num_seqs``) or KV blocks it cannot otherwise get; never for the token budget
  (that frees within a step or two) and never for an equal or less urgent request.
- The victim is the last running request: the least urgent, newest admitted (the running
  list is sorted by priority, :func:`~.priority_queue.insert_running`); with equal
  priorities this is the scheduler's old rule, the newest. Its blocks are freed as any
  preemption's are and stay in the prefix cache, so it resumes from them, first in its level.
- A victim is never a request already given slots this step: allocating slots registers
  the blocks they fill in the prefix cache, so a request dropped after it would leave
  hashes naming KV never written. Hence the urgent ones are admitted before the step
  reaches the less urgent running requests, not after.
- Starvation: a running decode is never held back by priority, only preempted. A prompt
  chunk, running or newly admitted, leaves one token of the step's budget for each less
  urgent running decode (:func:`decode_reserve`); a less urgent prompt chunk gets what the
  urgent ones leave. A
  preempted request waits while more urgent work keeps arriving (by design, as in vLLM);
  it is first of its level when that work is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .kv_loads import clamp_tiers
from .prefill_shares import charge_share, within_share
from .priority_queue import insert_running, victim_for
from .request import RequestStatus

if TYPE_CHECKING:
    from ..kv_transfer.leases import Leases
    from .block_pool import KVCacheBlock
    from .kv_cache_manager import KVCacheManager
    from .kv_loads import KVLoads
    from .priority_queue import PriorityFairQueue
    from .request import Request
    from .scheduler_types import ScheduledRequest, SchedulerConfig


@dataclass
class StepState:
    """What one step's scheduling has decided so far, shared by its two phases."""

    budget: int  # tokens left in the step
    shares: dict[str | None, int] | None  # prompt tokens left per tenant (None: no shares)
    partial: dict[str | None, int] | None  # prompts part-way per tenant (copied: it counts)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    stopped: bool = False  # a waiting request did not fit: no more admissions this step

    def __post_init__(self) -> None:
        if self.partial is not None:
            self.partial = dict(self.partial)


def decode_reserve(running: list[Request]) -> dict[int, int] | None:
    """Per priority level of ``running`` (sorted), its less urgent decodes: the tokens a
    prompt chunk at that level leaves in the budget for them. None when every running
    request is at one level (no reserve: the step is the priority-less one)."""
    if not running or running[0].priority == running[-1].priority:
        return None
    reserve: dict[int, int] = {}
    behind = 0  # decodes at levels less urgent than the one being counted
    level, here = running[-1].priority, 0
    for req in reversed(running):
        if req.priority != level:
            behind += here
            level, here = req.priority, 0
        reserve[level] = behind
        here += req.num_tokens - req.num_computed_tokens == 1
    return reserve


class Admission:
    """Needs the scheduler's queues, pool and these of its helpers."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    running: list[Request]
    waiting: PriorityFairQueue[Request]
    kv_loads: KVLoads | None
    leases: Leases | None
    unfit_req_ids: list[str]

    if TYPE_CHECKING:

        @property
        def loading(self) -> object: ...
        def _running_loras(self) -> set[str]: ...
        def _lora_admits(self, req: Request, loras: set[str]) -> bool: ...
        def _first_chunk(
            self, req: Request, budget: int
        ) -> tuple[list[KVCacheBlock], int, int]: ...
        def _finish(self, req: Request, status: RequestStatus) -> None: ...
        def _preempt(self, req: Request, counted: bool = True) -> None: ...
        def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest: ...

    def _admit(self, step: StepState, at: int, bound: int | None) -> int:
        """Admits waiting requests, by priority, then tenants in turn (those more urgent than
        ``bound`` only; None: all), into ``running`` at ``at`` or before (returns how many).

        A request that does not fit ends this step's admissions (``step.stopped``: no
        skipping), unless a running request strictly less urgent and not yet given slots
        this step (index ``at`` on) can be preempted for it: the least urgent, newest one
        goes (:func:`~.priority_queue.victim`), for a batch slot (``max_num_seqs``) or for
        blocks. Decodes are never starved by it: admitted ahead of less urgent running
        requests, the newcomers leave one token of the budget for each of their decodes."""
        cfg, kv = self.config, self.kv_cache_manager
        waiting, running, shares, partial = self.waiting, self.running, step.shares, step.partial
        reserve = 0  # budget kept for the less urgent decodes
        if bound is not None:
            reserve = sum(r.num_tokens - r.num_computed_tokens == 1 for r in running[at:])
        start = at  # victims only from here on: not yet given slots this step
        skipped = 0  # tenants passed over in a row (their share of this step is spent)
        loras = self._running_loras() if cfg.max_loras else None
        held: list[Request] = []  # passed over for their adapter; back in front after
        while waiting and step.budget - reserve > 0:
            req = waiting.peek()
            if bound is not None and req.priority >= bound:
                break  # the rest are no more urgent than the running request at ``at``
            full = len(running) >= cfg.max_num_seqs
            if full or (kv.get_num_free_blocks() == 0 and running and not self.leases):
                # admission always needs a new block (a hit stops before the end)
                if (victim := victim_for(running, start, req)) is None:
                    step.stopped = True
                    break
                if loras is None or self._lora_admits(req, loras):  # else no use preempting
                    reserve -= self._preempt_for(victim, step)
                    continue
            if loras is not None and not self._lora_admits(req, loras):
                held.append(waiting.popleft())
                continue
            hit_blocks, num_hit, num_new = self._first_chunk(req, step.budget - reserve)
            loads = self.kv_loads
            if loads is not None and loads.start(req, hit_blocks, alone=not step.scheduled):
                continue
            if not num_new:
                step.stopped = True
                break  # the whole prompt must fit one step, and it does not
            num_new = within_share(shares, req, num_new)
            starts_partial = partial is not None and num_new < req.num_tokens - num_hit
            if starts_partial and partial.get(req.tenant, 0) >= cfg.max_num_partial_prefills:
                num_new = 0  # its tenant has enough prompts under way
            if num_new <= 0:  # its tenant's share of this step is spent: the next one
                if skipped >= waiting.num_groups:
                    step.stopped = True
                    break
                waiting.rotate()
                skipped += 1
                continue
            if kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
                if self.leases is not None and self.leases.revoke_oldest():
                    continue  # a lease's blocks are free again: its puller recomputes
                if (victim := victim_for(running, start, req)) is not None:
                    reserve -= self._preempt_for(victim, step)
                    continue
                if self.loading:  # KV loads hold blocks: they land soon and free them
                    step.stopped = True
                    break
                if not running:  # should not happen given max_model_len; if it
                    # does, the request fails alone, with an output (never a hang)
                    waiting.popleft()
                    req.error = "kv cache capacity: its blocks do not fit an empty cache"
                    self._finish(req, RequestStatus.FINISHED_ERROR)
                    self.unfit_req_ids.append(req.request_id)
                    continue
                step.stopped = True
                break
            kv.count_lookup(req, num_hit)
            waiting.popleft()
            if loras is not None and req.lora_name is not None:
                loras.add(req.lora_name)
            insert_running(running, req)
            start += 1
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                if req.tier_cached_tokens:  # what its load brought, within its hit
                    clamp_tiers(req.tier_cached_tokens, num_hit)
            req.num_computed_tokens = num_hit
            step.scheduled.append(self._scheduled(req, num_new))
            step.budget -= num_new
            skipped = 0
            if starts_partial:
                partial[req.tenant] = partial.get(req.tenant, 0) + 1
            charge_share(shares, req, num_new)
        for req in reversed(held):
            waiting.appendleft(req)
        return start - at

    def _preempt_for(self, victim: Request, step: StepState) -> int:
        """Preempts the last running request for a more urgent one; 1 if it was a decode
        (its token of the budget is no longer kept for it), else 0."""
        decode = int(victim.num_tokens - victim.num_computed_tokens == 1)
        self.running.pop()
        self._preempt(victim)
        step.preempted.append(victim)
        return decode
