"""One simulated replica: the engine's own :class:`Scheduler` and :class:`KVCacheManager`,
stepped by the fleet's clock.

Why the real scheduler: a second scheduling loop in the simulator drifts silently from the
engine's (it once lacked the fair queue, the tenant shares and the partial-prefill limits),
and then the simulator's predictions say nothing about the engine. Here each step is what
an engine's step is: :meth:`Scheduler.schedule`, a batch, :meth:`Scheduler.update_from_output`.
What the engine's model runner would do is done here without a model:

- time: the step lasts what the cost model gives for the batch the scheduler produced,
  as a cost-model replica (``sim:<profile>``) sleeps for it;
- sampling: every request that reaches the end of its tokens gets token 0 (outputs are
  zeros, unique by the hash chain, as before); a request has no EOS and ``max_tokens``
  equal to its output length, so the scheduler ends it exactly where the workload says;
- requests that arrive during a step wait in an inbox and are added between steps, as the
  engine thread drains its command queue between steps;
- a host KV tier, when the fleet has one (``host_blocks``): :mod:`.host_tier`'s manager in
  place of the engine's, and the step lasts at least as long as the block copies it made
  to and from host memory (``CostModel.transfer_s``);
- a replica of a P/D fleet (``attach``): its scheduler gets the engine's leases (prefill)
  or its pulls (decode, :mod:`.disagg`); a ``kv_handoff`` request that got its first token
  is handed off with :meth:`Scheduler.hand_off`, as the engine does after that step, and
  :mod:`.disagg` takes it from :attr:`SimReplica.handoffs`.

The scheduler reads no clock: time enters only as a request's ``arrival_time``, which the
fleet stamps with its own. A step that starts a run of pure decode steps
(:meth:`Scheduler.decode_run_after`) is taken with the run in one event whose step times are
summed in numpy, cut short when a request arrives meanwhile; what the steps of the run would
publish (the first step's block events, load reports when due) goes out at those steps'
ends, so the result is the same as step by step.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import msgspec

from kvroute.events import MEDIUM_CPU, BlockHasher, KVCacheEvent
from kvroute.events.load import LoadReport
from kvroute.events.replica_api import SamplingParams
from kvroute.replica.core.kv_cache_manager import KVCacheManager
from kvroute.replica.core.load_report import load_report
from kvroute.replica.core.request import Request
from kvroute.replica.core.scheduler import Scheduler
from kvroute.replica.core.scheduler_types import SchedulerConfig, SchedulerOutput
from kvroute.replica.kv_transfer.leases import Lease
from kvroute.replica.model.cost_model import CostModel

from .host_tier import TieredKVCacheManager
from .lora import SimLoRA
from .workloads import RequestSpec

OUTPUT_TOKEN = 0  # what every simulated step samples


class _AllSample(dict):
    """Every request samples :data:`OUTPUT_TOKEN` (no dict built per step)."""

    def __contains__(self, request_id: object) -> bool:
        return True

    def __missing__(self, request_id: str) -> int:
        return OUTPUT_TOKEN


_SAMPLED: dict[str, int] = _AllSample()


class SimRequest(Request):
    """The engine's :class:`Request`, tokens kept as uint32 arrays (4 bytes a token, not a
    list of int objects: thousands of long prompts queue at once past saturation), plus what
    a run records: where it went, its first token and its end in simulated seconds."""

    # True while a P/D request's decode part waits for its first token on its decode
    # replica (:class:`.disagg.HandedOff`): the client has its first token; the router's
    # load view is told of that replica's first one all the same.
    resumed = False

    def __init__(
        self, idx: int, spec: RequestSpec, tokens: array, arrival_s: float, tenant: bool = True
    ) -> None:
        super().__init__(
            f"r{idx}",
            tokens,
            SamplingParams(max_tokens=spec.output_length, ignore_eos=True),
            cache_salt=spec.cache_salt,
            lora_name=spec.lora_name,
            arrival_time=arrival_s,
            # a workload's salt is its tenant (kvroute bench: a key each); without, one group
            tenant=spec.cache_salt if tenant else None,
        )
        self.idx, self.spec = idx, spec
        self.host_hit = 0  # of its hit (at first admission), the tokens loaded from the host
        self.scheduled_s: float | None = None  # its first step's start (queued until then)
        self.first_s: float | None = None
        self.done_s: float | None = None
        self.replica = -1

    def _init_tokens(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
    ) -> None:
        prompt = array("I", prompt_token_ids)
        self.prompt_token_ids = prompt  # type: ignore[assignment]
        self.all_token_ids = array("I", prompt)  # type: ignore[assignment]
        self.all_token_ids.extend(output_token_ids)
        self._output_token_ids = list(output_token_ids)

    def release(self) -> None:
        """Drops the token buffers of a finished request (its figures stay)."""
        self.prompt_token_ids = self.all_token_ids = array("I")  # type: ignore[assignment]

    @property
    def prompt_len(self) -> int:
        return self.spec.input_length

    @property
    def output_len(self) -> int:
        return self.spec.output_length

    @property
    def hit(self) -> int | None:
        """Prompt tokens hit at its first admission; None before it."""
        return self.num_cached_tokens if self.num_cached_tokens >= 0 else None


@dataclass(slots=True, eq=False)
class DecodeRun:
    """A step scheduled for real (``first``) and the decode steps that follow it unchanged,
    in flight as one event, from ``t0``; ``ends[j - 1]``: when its j-th step ends."""

    id: int
    t0: float
    ends: list[float]
    first: SchedulerOutput
    events: list[KVCacheEvent]  # the first step's, published at its end
    steps: int = field(init=False)  # planned, or fewer when cut short

    def __post_init__(self) -> None:
        self.steps = len(self.ends)


class SimReplica:
    """A replica's scheduler, the step in flight, and what it computed."""

    __slots__ = (
        "alive",
        "attach",
        "busy_s",
        "cost",
        "decode_tokens",
        "epoch",
        "fast_decode",
        "handoffs",
        "hasher",
        "host_blocks",
        "id",
        "inbox",
        "last_deliver",
        "last_report",
        "loaded_tokens",
        "lora",
        "num_blocks",
        "num_runs",
        "preemptions",
        "prefill_tokens",
        "resumed",
        "routed",
        "run",
        "sched_config",
        "scheduler",
        "step",
        "stored_tokens",
        "transfer_s",
        "version",
    )  # fmt: skip

    def __init__(
        self,
        i: int,
        sched_config: SchedulerConfig,
        num_blocks: int,
        hasher: BlockHasher,
        cost: CostModel,
        fast_decode: bool = True,
        host_blocks: int = 0,
        lora: SimLoRA | None = None,
        attach: Callable[[Scheduler], None] | None = None,
    ) -> None:
        """``attach``: called with each new scheduler (at start, after a crash): a P/D
        fleet's leases and pulls (:meth:`.disagg.Disagg.attach`)."""
        self.id = f"replica-{i}"
        self.attach = attach
        self.handoffs: list[tuple[SimRequest, Lease | None]] = []  # since the last step
        self.lora = lora  # its adapters' slots and host LRU (None: it serves none)
        self.sched_config, self.num_blocks, self.hasher = sched_config, num_blocks, hasher
        self.host_blocks = host_blocks  # 0: no host tier
        self.loaded_tokens = self.stored_tokens = 0  # host tier copies, in and out
        self.transfer_s = 0.0  # their time on the host link
        self.cost, self.fast_decode = cost, fast_decode
        self.scheduler = self._new_scheduler()
        self.inbox: list[SimRequest] = []
        self.step: SchedulerOutput | None = None  # a normal step in flight
        self.run: DecodeRun | None = None  # a run of decode steps in flight
        self.version = self.epoch = self.routed = self.prefill_tokens = self.decode_tokens = 0
        self.preemptions = self.num_runs = 0
        self.resumed = 0  # P/D decode parts here before their first token (see start_step)
        self.busy_s, self.last_deliver, self.last_report = 0.0, 0.0, -1.0
        self.alive = True

    def _new_scheduler(self) -> Scheduler:
        if self.host_blocks:
            kv = TieredKVCacheManager(self.num_blocks, self.hasher, self.host_blocks)
        else:
            kv = KVCacheManager(self.num_blocks, self.hasher)
        lora = self.lora
        if lora is None:
            sched = Scheduler(self.sched_config, kv)
        else:
            sched = Scheduler(self.sched_config, kv, lora.ready)
        if self.attach is not None:
            self.attach(sched)
        return sched

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def busy(self) -> bool:
        return self.step is not None or self.run is not None

    def load_report(self, run_steps: int = 0) -> LoadReport:
        """As the engine reports it; requests in the inbox count as waiting. ``run_steps``:
        as it would after that many steps of the run in flight (each adds a token of decode
        context per running request; nothing else in the report moves during a run)."""
        sched = self.scheduler
        report = load_report(chain(self.inbox, sched.waiting), sched.running, self.kv)
        if self.lora is not None:  # the engine's scheduler adds them the same way
            running = {r.lora_name for r in sched.running if r.lora_name is not None}
            report = msgspec.structs.replace(report, **self.lora.residency(running))
        if run_steps:
            extra = run_steps * len(sched.running)
            report = msgspec.structs.replace(
                report, decode_context_tokens=report.decode_context_tokens + extra
            )
        if sched.kv_loads is not None or sched.leases is not None:  # P/D, as the engine's
            link = getattr(sched.kv_loads, "bytes_per_s", 0.0)  # its pulls' measured rate
            if link:
                report = msgspec.structs.replace(report, kv_link_bytes_per_s=link)
            if sched.leases is not None and len(sched.leases):
                report = msgspec.structs.replace(report, kv_leased_blocks=sched.leases.num_blocks)
        return report

    def crash(self) -> list[SimRequest]:
        """The engine process is gone: a fresh scheduler over an empty pool; returns the
        requests it held (running, waiting, in its inbox)."""
        sched = self.scheduler
        orphans: list[SimRequest] = [*sched.running, *sched.waiting, *self.inbox]  # type: ignore[list-item]
        if self.lora is not None:  # a fresh process holds no adapter
            lora = self.lora
            lora.slots.clear()
            lora.host.clear()
            lora.reading.clear()
        self.scheduler = self._new_scheduler()
        self.inbox = []
        self.handoffs = []
        self.resumed = 0
        self.step = self.run = None
        self.version += 1
        return orphans

    # -- steps -------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Adds the inbox, then schedules the next step: its duration (a run's, when it
        starts one), or None when there is nothing to run."""
        sched = self.scheduler
        for req in self.inbox:
            sched.add_request(req)
            if req.resumed:
                self.resumed += 1
        self.inbox.clear()
        if not sched.has_unfinished_requests():
            return None  # an engine with nothing to do waits for its queue
        if self.lora is not None:
            self.lora.now = now
        out = sched.schedule()
        self.preemptions += len(out.preempted_request_ids)
        if out.is_empty:
            return None
        tokens = ctx = prefill = decode = pos = 0
        pairs = 0.0
        for sr in out.scheduled:
            if sr.request.scheduled_s is None:  # type: ignore[attr-defined]
                sr.request.scheduled_s = now  # type: ignore[attr-defined]
            n, p0 = sr.num_new_tokens, sr.num_computed_tokens
            tokens += n
            pairs += n * p0 + n * (n - 1) / 2
            ctx += p0 + n
            pos += p0
            if n == 1 and sr.request.num_output_tokens and p0 + 1 >= sr.num_tokens:
                decode += 1
            else:
                prefill += n
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.version += 1
        transfer = self._transfers() if self.host_blocks else 0.0
        adapter_s = self._adapter_copies(out) if self.lora is not None else 0.0
        # A run is not taken while adapters are read: a read's end may admit a request; nor
        # while a P/D decode part awaits its first token here: the router hears of it at
        # that step's end, not the run's.
        plain = not transfer and not adapter_s and not (self.lora and self.lora.reading)
        plain = plain and not self.resumed
        more = sched.decode_run_after(out) if self.fast_decode and plain else 0
        if more:  # this step and ``more`` like it: one event
            self.num_runs += 1
            ends = self.cost.decode_run(len(out.scheduled), pos, more + 1, now)
            self.run = DecodeRun(self.num_runs, now, ends, out, self.kv.take_events())
            return ends[-1] - now
        dt = self.cost.step_time(tokens, pairs, ctx, transfer) + adapter_s
        self.busy_s += dt
        self.step = out
        return dt

    def _adapter_copies(self, out: SchedulerOutput) -> float:
        """Seconds the step spends copying its adapters into slots (before its forward)."""
        lora = self.lora
        assert lora is not None
        needed = {sr.request.lora_name for sr in out.scheduled if sr.request.lora_name}
        if not needed:
            return 0.0
        running = {r.lora_name for r in self.scheduler.running if r.lora_name is not None}
        return lora.step(needed, running) * lora.load_s  # type: ignore[arg-type]

    def _transfers(self) -> float:
        """The host link's seconds for the step just scheduled: its loads and copies out."""
        kv = self.kv
        assert isinstance(kv, TieredKVCacheManager)
        loaded, stored = kv.take_copies()
        if not loaded and not stored:
            return 0.0
        bs = self.hasher.block_size
        self.loaded_tokens += loaded * bs
        self.stored_tokens += stored * bs
        t = self.cost.transfer_s(MEDIUM_CPU, loaded * bs, stored * bs)
        self.transfer_s += t
        return t

    def cut_run(self, now: float) -> float | None:
        """A request arrived during a run of decode steps: the run ends with the step in
        progress (the next one would see the newcomer). The run's new end time, or None when
        that is its planned end already."""
        run = self.run
        assert run is not None
        m = bisect_left(run.ends, now, hi=run.steps) + 1
        if m >= run.steps:
            return None
        run.steps = m
        self.version += 1
        return run.ends[m - 1]

    def take_events(self) -> list[KVCacheEvent]:
        """What the pool changed since the last publish (a run's first step's included)."""
        events = self.kv.take_events()
        if self.run is not None and self.run.events:
            events, self.run.events = self.run.events + events, []
        return events

    def end_step(self) -> tuple[list[SimRequest], list[SimRequest]]:
        """Applies the step (or run) in flight as the engine would its sampled tokens;
        returns (requests that got their first token, requests that finished)."""
        sched = self.scheduler
        run = self.run
        out = run.first if run is not None else self.step
        self.step = None
        assert out is not None
        first: list[SimRequest] = []
        finished: list[SimRequest] = []
        for req in sched.update_from_output(out, _SAMPLED):  # type: ignore[assignment]
            if req.first_s is None:
                first.append(req)
            elif req.resumed:  # its first token here (the client had one from elsewhere)
                first.append(req)
                self.resumed -= 1
            if req.is_finished:
                finished.append(req)
        if sched.leases is not None:  # the engine hands off after the step's first tokens
            for req in first:
                if req.kv_handoff and not req.is_finished:
                    self.handoffs.append((req, sched.hand_off(req)))
        if run is not None:
            self.busy_s += run.ends[run.steps - 1] - run.t0
            if run.steps > 1:
                self.decode_tokens += (run.steps - 1) * len(sched.running)
                finished += sched.advance_decode_run(run.steps - 1, OUTPUT_TOKEN)  # type: ignore[arg-type]
        return first, finished
