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
  engine thread drains its command queue between steps.

The scheduler reads no clock: time enters only as a request's ``arrival_time``, which the
fleet stamps with its own. Runs of pure decode steps (:meth:`Scheduler.decode_run_length`)
are advanced in one event whose step times are summed in numpy, and cut short when a
request arrives meanwhile; the result is the same as step by step.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain

import numpy as np

from kvroute.events import BlockHasher
from kvroute.events.load import LoadReport
from kvroute.events.replica_api import SamplingParams
from kvroute.replica.cost_model import CostModel
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.request import Request
from kvroute.replica.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, load_report

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

    def __init__(self, idx: int, spec: RequestSpec, tokens: array, arrival_s: float) -> None:
        super().__init__(
            f"r{idx}",
            tokens,
            SamplingParams(max_tokens=spec.output_length, ignore_eos=True),
            cache_salt=spec.cache_salt,
            arrival_time=arrival_s,
            tenant=spec.cache_salt,  # a workload's salt is its tenant (kvroute bench: a key each)
        )
        self.idx, self.spec = idx, spec
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


class SimReplica:
    """A replica's scheduler, the step in flight, and what it computed."""

    __slots__ = (
        "alive",
        "busy_s",
        "cost",
        "decode_tokens",
        "epoch",
        "fast_decode",
        "hasher",
        "id",
        "inbox",
        "last_deliver",
        "last_report",
        "macro",
        "num_blocks",
        "preemptions",
        "prefill_tokens",
        "routed",
        "sched_config",
        "scheduler",
        "step",
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
    ) -> None:
        self.id = f"replica-{i}"
        self.sched_config, self.num_blocks, self.hasher = sched_config, num_blocks, hasher
        self.cost, self.fast_decode = cost, fast_decode
        self.scheduler = self._new_scheduler()
        self.inbox: list[SimRequest] = []
        self.step: SchedulerOutput | None = None  # a normal step in flight
        self.macro: tuple[float, np.ndarray, int] | None = None  # (start, cum times, steps)
        self.version = self.epoch = self.routed = self.prefill_tokens = self.decode_tokens = 0
        self.preemptions = 0
        self.busy_s, self.last_deliver, self.last_report = 0.0, 0.0, -1.0
        self.alive = True

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.sched_config, KVCacheManager(self.num_blocks, self.hasher))

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def busy(self) -> bool:
        return self.step is not None or self.macro is not None

    def load_report(self) -> LoadReport:
        """As the engine reports it; requests in the inbox count as waiting."""
        sched = self.scheduler
        return load_report(chain(self.inbox, sched.waiting), sched.running, self.kv)

    def crash(self) -> list[SimRequest]:
        """The engine process is gone: a fresh scheduler over an empty pool; returns the
        requests it held (running, waiting, in its inbox)."""
        sched = self.scheduler
        orphans: list[SimRequest] = [*sched.running, *sched.waiting, *self.inbox]  # type: ignore[list-item]
        self.scheduler = self._new_scheduler()
        self.inbox = []
        self.step = self.macro = None
        self.version += 1
        return orphans

    # -- steps -------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Adds the inbox, then starts the next step: its duration, or None when there is
        nothing to run."""
        sched = self.scheduler
        for req in self.inbox:
            sched.add_request(req)
        self.inbox.clear()
        if not sched.has_unfinished_requests():
            return None  # an engine with nothing to do waits for its queue
        if self.fast_decode:
            k = sched.decode_run_length(min_steps=2)
            if k >= 2:
                pos = sum(r.num_computed_tokens for r in sched.running)
                cum = self.cost.decode_run(len(sched.running), pos, k)
                self.macro = (now, cum, k)
                self.version += 1
                return float(cum[-1])
        out = sched.schedule()
        self.preemptions += len(out.preempted_request_ids)
        if out.is_empty:
            return None
        tokens = ctx = prefill = decode = 0
        pairs = 0.0
        for sr in out.scheduled:
            n, p0 = sr.num_new_tokens, sr.num_computed_tokens
            tokens += n
            pairs += n * p0 + n * (n - 1) / 2
            ctx += p0 + n
            if n == 1 and sr.request.num_output_tokens and p0 + 1 >= sr.num_tokens:
                decode += 1
            else:
                prefill += n
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        dt = self.cost.step_time(tokens, pairs, ctx)
        self.busy_s += dt
        self.step = out
        self.version += 1
        return dt

    def cut_run(self, now: float) -> float | None:
        """A request arrived during a run of decode steps: the run ends with the step in
        progress (the next one would see the newcomer). The run's new end time, or None when
        that is its planned end already."""
        assert self.macro is not None
        t0, cum, k = self.macro
        m = min(int(np.searchsorted(cum, now - t0, side="left")) + 1, k)
        if m >= k:
            return None
        self.macro = (t0, cum, m)
        self.version += 1
        return t0 + float(cum[m - 1])

    def end_step(self) -> tuple[list[SimRequest], list[SimRequest]]:
        """Applies the step (or run) in flight as the engine would its sampled tokens;
        returns (requests that got their first token, requests that finished)."""
        sched = self.scheduler
        if self.macro is not None:
            _, cum, m = self.macro
            self.macro = None
            self.busy_s += float(cum[m - 1])
            self.decode_tokens += m * len(sched.running)
            finished = sched.advance_decode_run(m, OUTPUT_TOKEN)
            return [], finished  # type: ignore[return-value]
        out, self.step = self.step, None
        assert out is not None
        first: list[SimRequest] = []
        finished: list[SimRequest] = []
        for req in sched.update_from_output(out, _SAMPLED):  # type: ignore[assignment]
            if req.first_s is None:
                first.append(req)
            if req.is_finished:
                finished.append(req)
        return first, finished
