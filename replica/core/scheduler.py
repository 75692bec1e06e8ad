"""Continuous-batching scheduler over a :class:`KVCacheManager` (vLLM v1's design).

One step = one call to :meth:`Scheduler.schedule`, one forward pass of the model runner,
one call to :meth:`Scheduler.update_from_output`. Per step:

1. running requests, most urgent first (``priority``, vLLM's meaning: lower first), then
   oldest admitted: a decode costs 1 token, a partially prefilled request continues its
   prompt with as many tokens as the budget leaves (chunked prefill); when the pool runs
   out of blocks, the last running request (least urgent, newest) is preempted (recompute:
   its blocks are freed, it goes back to the FRONT of its tenant's queue, outputs kept);
2. if nobody was preempted, waiting requests by priority, then in fair-queue order
   (:mod:`.priority_queue`, :mod:`.fair_queue`: round-robin across tenants, FCFS within
   one; requests with no tenant are one group): a prefix-cache lookup, then slots for the
   rest of the prompt (or the first chunk of it). A request that does not fit stops
   admission for this step (no skipping). Waiting requests more urgent than some running
   ones are admitted before the step reaches those, and may preempt them for a batch slot
   or blocks (:mod:`.admission` has the rules, starvation included). With every request at
   one priority, the step is exactly the priority-less one.

While two or more tenants have prompt tokens to compute, a step's prompt tokens are bounded
and go to the least-served tenant first (:meth:`Scheduler._prefill_shares`,
:class:`~.fair_queue.TenantUsage`); ``max_num_partial_prefills`` bounds how many prompts of
one tenant are part-way at once. Decodes are never held back for fairness. The threshold is
counted in cost (``attention_weight``): a chunk deep in a long prompt attends to more, so it
is shorter, and no step of it takes longer than the threshold's tokens at a prompt's start.

``num_computed_tokens`` advances at schedule time, so the runner reads the pre-step value
from :class:`ScheduledRequest`. No request holds blocks while waiting.

Clock: none. Nothing here reads time; a request's ``arrival_time`` is stamped by whoever
creates it, so the engine steps this scheduler in real time and the fleet simulator
(``kvroute.sim``) in its own virtual time, on the same code. For the simulator,
:mod:`.decode_run` advances runs of pure decode steps at once, to the same state.

Liveness: ``max_model_len`` is capped to what the whole cache holds (and, without chunked
prefill, to the token budget), prompts beyond it are rejected at :meth:`add_request`, and a
request finishes with ``length`` at it. So a request alone in the engine always fits, and
everything running can always make progress by preempting others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import msgspec

from kvroute.events.load import LoadReport

from .admission import Admission, StepState, decode_reserve
from .block_pool import KVCacheBlock
from .decode_run import DecodeRuns
from .fair_queue import TenantUsage
from .kv_cache_manager import KVCacheManager
from .kv_loads import KVLoads
from .load_report import load_report
from .prefill_shares import PrefillShares, charge_share, within_share
from .priority_queue import PriorityFairQueue
from .request import Request, RequestStatus
from .scheduler_types import (
    RequestTooLongError,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from ..kv_tiers.tiers import KVTiers
    from ..kv_transfer.leases import Lease, Leases

log = logging.getLogger(__name__)
_NO_LOADS: Mapping[str, Any] = MappingProxyType({})
_RUNNING = RequestStatus.RUNNING  # an enum member read from its class costs a lookup per use


class Scheduler(Admission, PrefillShares, DecodeRuns):
    """Decides, each step, which requests run and how many tokens each feeds."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        lora_ready: Callable[[Request], bool] | None = None,
        lora_residency: Callable[[set[str]], dict[str, Any]] | None = None,
    ) -> None:
        """``lora_ready(request)``: whether its adapter is in memory, so a step can use it
        (it may start reading it; it never waits). None: every adapter is.
        ``lora_residency(running)``: the ``LoadReport`` fields saying where adapters are
        (``LoRAStore.residency``; ``running``: the running requests' adapters), added to
        each load report; None: no adapters."""
        self.config = config
        self.lora_ready = lora_ready
        self.lora_residency = lora_residency
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        capacity = kv_cache_manager.block_pool.num_blocks * self.block_size
        limit = min(config.max_model_len, capacity)
        if not config.enable_chunked_prefill:
            # A (re)computed prompt must fit one step's budget, or it would wait forever.
            limit = min(limit, config.max_num_batched_tokens)
        if limit < 2:
            raise ValueError(f"the KV cache / token budget allow only {limit} token(s)")
        self.max_model_len = limit  # the effective limit: prompt + outputs < this + 1
        self.requests: dict[str, Request] = {}  # live (unfinished) requests by id
        self.waiting: PriorityFairQueue[Request] = PriorityFairQueue(_tenant_of)
        # most urgent first, in admission order within a level: preemption takes the last
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        # ended by the scheduler because they can never fit; the engine owes each an output
        self.unfit_req_ids: list[str] = []
        self.num_preemptions = 0  # total, over the scheduler's life
        self.usage = TenantUsage()  # who is served first when tenants compete
        # Lower KV tiers (kv_loads): a waiting request whose prefix goes on there has it
        # loaded first, out of the queue and holding its blocks, until the load lands.
        self.kv_loads: KVLoads | None = None
        # P/D: the prompt blocks of handed-off requests, held for the replicas decoding them.
        self.leases: Leases | None = None

    def use_leases(self, leases: Leases) -> None:
        """Requests with ``kv_handoff`` end after their first token, their blocks leased."""
        self.leases = leases

    def use_tiers(self, tiers: KVTiers) -> None:
        """Loads prefixes found in these lower KV tiers instead of recomputing them."""
        self.kv_loads = KVLoads(tiers, self.kv_cache_manager, self.waiting)

    @property
    def loading(self) -> Mapping[str, tuple[Request, list[KVCacheBlock]]]:
        """Requests whose lower-tier load is in flight (out of ``waiting``, holding blocks)."""
        return self.kv_loads.loading if self.kv_loads is not None else _NO_LOADS

    # -- requests in and out -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request, or rejects it at once if it could never run here."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} is not fresh ({request.status.name})")
        n = request.num_tokens
        if n + 1 > self.max_model_len:
            cfg = self.config
            capacity = self.kv_cache_manager.block_pool.num_blocks * self.block_size
            why = f"max_model_len={cfg.max_model_len}"
            if capacity < cfg.max_model_len:
                why += f", whole KV cache={capacity} tokens"
            if not cfg.enable_chunked_prefill:
                why += f", max_num_batched_tokens={cfg.max_num_batched_tokens} (no chunking)"
            raise RequestTooLongError(
                f"request {rid!r}: {n} prompt tokens + 1 output exceed the limit of "
                f"{self.max_model_len} tokens ({why})"
            )
        self.requests[rid] = request
        self.waiting.append(request)
        self.usage.arrived(request.tenant)
        if request.kv_source is not None and self.kv_loads is not None:
            self.kv_loads.track(request)  # its lease at the source is kept while it waits

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Ends live requests (stop string, abort); frees their blocks now. Unknown or
        already finished ids are ignored: a client may abort a request that just ended."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif rid not in self.loading:  # a load in flight lands, then is dropped
                self.waiting.remove(req)
            self._finish(req, status)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """A client went away: its blocks go back to the pool at once."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Bookkeeping for a request already taken out of ``waiting``/``running``."""
        req.status = status
        if req.kv_source is not None and self.kv_loads is not None:
            self.kv_loads.drop_source(req)  # ended before its pull: its lease goes now
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)
        self.usage.left(req.tenant)

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.kv_loads is not None:
            self.kv_loads.poll()  # landed loads and failed disk writes, on this thread
        if self.leases is not None:
            self.leases.poll()  # released and expired leases give their blocks back
        partial = self._partial_prefills()
        shares = self._prefill_shares(partial)
        scheduled, preempted = self._schedule(shares, partial)
        if shares is not None and not scheduled and not preempted:
            # The shares went to a tenant that could not run after all (its request did not
            # fit): rather than a step that does nothing, schedule as if alone. Liveness.
            scheduled, preempted = self._schedule(None, partial)
        charge, num_tokens = self.usage.charge, 0
        for sr in scheduled:
            charge(sr.request.tenant, sr.num_new_tokens)
            num_tokens += sr.num_new_tokens
        finished = sorted(self.finished_req_ids) if self.finished_req_ids else []
        self.finished_req_ids = set()
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=num_tokens,
            preempted_request_ids=[r.request_id for r in preempted],
            finished_request_ids=finished,
        )

    def _schedule(
        self, shares: dict[str | None, int] | None, partial: dict[str | None, int] | None
    ) -> tuple[list[ScheduledRequest], list[Request]]:
        """One step's chunks and preemptions, within ``shares`` (see :meth:`_prefill_shares`)
        and the partial-prefill limit (``partial``: prompts part-way per tenant, not changed).
        Running requests go most urgent first; before the first one less urgent than the
        most urgent waiting request, the waiting ones more urgent than it are admitted
        (:meth:`_admit`), so that only requests not yet given slots are preempted for them."""
        kv = self.kv_cache_manager
        step = StepState(self.config.max_num_batched_tokens, shares, partial)
        scheduled, preempted = step.scheduled, step.preempted
        pressed = False  # a running request lacked blocks: nobody is admitted this step

        # 1. Running requests: decodes and unfinished prefill chunks.
        i, running = 0, self.running
        top = self.waiting.top_priority
        # prompt chunks leave a token per less urgent decode (None: one level, no reserve)
        reserve = decode_reserve(running)
        while i < len(running) and step.budget > 0:
            req = running[i]
            if top is not None and top < req.priority and not pressed:
                i += self._admit(step, i, req.priority)  # admitted ones precede req now
                top = None if step.stopped else self.waiting.top_priority
                if top is not None and top < req.priority:
                    top = None  # held for its adapter: tried once this step
                continue
            num_new = len(req.all_token_ids) - req.num_computed_tokens
            if num_new > 1:  # a prompt chunk (decodes are never capped, budget > 0)
                limit = self.config.chunk_limit(req.num_computed_tokens)
                if 0 < limit < num_new:
                    num_new = limit
                if num_new > step.budget:
                    num_new = step.budget
                if reserve is not None:
                    num_new = min(num_new, step.budget - reserve.get(req.priority, 0))
                if shares is not None:
                    num_new = within_share(shares, req, num_new)
            if num_new <= 0:  # nothing to feed yet, or its tenant's share is spent
                i += 1
                continue
            while kv.allocate_slots(req, num_new) is None:
                if self.leases is not None and self.leases.revoke_oldest():
                    continue  # a lease goes before a running request is preempted
                # the least urgent, newest (running is sorted); req itself when the last
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                pressed = True
                if victim is req:
                    break
            if req.status != _RUNNING:
                break  # req preempted itself: nothing after it is running any more
            scheduled.append(self._scheduled(req, num_new))
            step.budget -= num_new
            if shares is not None:
                charge_share(shares, req, num_new)
            i += 1

        # 2. Waiting requests, tenants in turn, unless this step already had to preempt.
        if not preempted and not step.stopped:
            self._admit(step, len(running), None)
        return scheduled, preempted

    def _running_loras(self) -> set[str]:
        """The distinct adapters of the running requests: each holds a device slot."""
        return {r.lora_name for r in self.running if r.lora_name is not None}

    def _lora_admits(self, req: Request, loras: set[str]) -> bool:
        """Whether admitting ``req`` keeps the running requests' adapters within
        ``max_loras`` and its adapter is in memory (vLLM's rule, plus the second part:
        an adapter still being read keeps its requests waiting, not the step)."""
        name = req.lora_name
        if name is None:
            return True
        if name not in loras and len(loras) >= self.config.max_loras:
            return False
        return self.lora_ready is None or self.lora_ready(req)

    def _first_chunk(self, req: Request, budget: int) -> tuple[list[KVCacheBlock], int, int]:
        """A waiting request's cached prefix (blocks, tokens) and the tokens its first step
        would compute within ``budget``; 0 of them when chunked prefill is off and its
        prompt does not fit. The lookup is not counted: a request passed over, or stuck at
        the head, must not inflate the hit-rate counters step after step."""
        cfg = self.config
        hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req, count=False)
        num_new = req.num_tokens - num_hit
        limit = cfg.chunk_limit(num_hit)
        if 0 < limit < num_new:
            num_new = limit
        if num_new > budget:
            num_new = budget if cfg.enable_chunked_prefill else 0
        return hit_blocks, num_hit, num_new

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        """Records the chunk and advances ``num_computed_tokens`` (blocks are allocated)."""
        ids = self.kv_cache_manager.get_block_ids(req.request_id)
        sr = ScheduledRequest(req, req.num_computed_tokens, num_new, ids, len(req.all_token_ids))
        req.num_computed_tokens += num_new
        return sr

    def recompute(self, req: Request) -> None:
        """Drops a running request's KV to compute it again from its first token, its tokens
        kept, first in its queue: for a model whose every key changes once a sequence
        reaches some length (transformers' Phi-3 at its rotary switch). Not counted as a
        preemption."""
        self.running.remove(req)
        self._preempt(req, counted=False)

    def _preempt(self, req: Request, counted: bool = True) -> None:
        """Recompute preemption: drop the KV, keep the tokens, queue it first."""
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.kv_load_tried = False  # what the device evicts of it meanwhile, a lower tier keeps
        if counted:
            req.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Appends the sampled tokens and applies token-level stops.

        Returns the requests that got a token this step (finished ones included). Requests
        finished or aborted since ``output`` was scheduled are skipped.
        """
        changed: list[Request] = []
        for sr in output.scheduled:
            req = sr.request  # below: sr.samples, inline (read per request per step)
            if req.status != _RUNNING or sr.num_computed_tokens + sr.num_new_tokens < sr.num_tokens:
                continue
            rid = req.request_id
            if rid not in sampled_token_ids:
                raise KeyError(f"no sampled token for request {rid!r}, which samples")
            try:  # this request's own data: a fault here ends it alone (FINISHED_ERROR)
                req.append_output_token(sampled_token_ids[rid])
                status = self._check_stop(req)
            except Exception as exc:
                log.warning("request %s: stop check failed", rid, exc_info=True)
                req.error = f"stop check failed: {type(exc).__name__}"
                status = RequestStatus.FINISHED_ERROR
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            changed.append(req)
        return changed

    def hand_off(self, req: Request) -> Lease | None:
        """Ends a running ``kv_handoff`` request after its first token: its computed full
        prompt blocks are leased (None: it has none) before its own hold is released, so
        they stay cached for the replica that pulls them."""
        kv = self.kv_cache_manager
        lease = None
        if self.leases is None:
            raise RuntimeError("hand_off needs leases (kv_transfer)")
        num_full = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
        num_full = min(num_full, kv.num_cached_block.get(req.request_id, 0))
        if num_full:
            lease = self.leases.grant(req.request_id, kv.req_to_blocks[req.request_id][:num_full])
        self.running.remove(req)
        self._finish(req, RequestStatus.FINISHED_HANDOFF)
        return lease

    def _check_stop(self, req: Request) -> RequestStatus | None:
        """Token-level stops; a stop token wins over length when both apply."""
        sp, output_ids = req.sampling_params, req.output_token_ids
        if len(output_ids) >= sp.min_tokens:
            last = output_ids[-1]
            if not sp.ignore_eos and last == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if len(output_ids) >= sp.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- observation -------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def load_report(self) -> LoadReport:
        report = load_report(self.waiting, self.running, self.kv_cache_manager)
        if self.lora_residency is not None:
            lora = self.lora_residency(self._running_loras())
            report = msgspec.structs.replace(report, **lora)
        if self.kv_loads is not None:
            state, timeouts = self.kv_loads.tiers.disk_state()
            if state:
                report = msgspec.structs.replace(
                    report, kv_disk_state=state, kv_disk_read_timeouts=timeouts
                )
            remote = self.kv_loads.tiers.remote
            if remote is not None and remote.bytes_per_s:
                report = msgspec.structs.replace(report, kv_link_bytes_per_s=remote.bytes_per_s)
        if self.leases is not None and len(self.leases):
            report = msgspec.structs.replace(report, kv_leased_blocks=self.leases.num_blocks)
        return report

    def stats(self) -> dict[str, int | float]:
        """The load report's figures (one definition of load) plus the cache counters."""
        load, kv = self.load_report(), self.kv_cache_manager
        return {
            "num_waiting": load.num_waiting,
            "num_running": load.num_running,
            "num_decoding": load.num_decoding,
            "num_queued_prefill_tokens": load.queued_prefill_tokens,
            "kv_cache_usage": kv.usage,
            "num_free_blocks": load.free_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "num_loading_kv": len(self.loading),  # waiting for blocks from a lower KV tier
            "num_leased_blocks": self.leases.num_blocks if self.leases is not None else 0,
        }


def _tenant_of(req: Request) -> str | None:
    """The fair queue's group: the request's tenant (None: the group of tenantless ones)."""
    return req.tenant
