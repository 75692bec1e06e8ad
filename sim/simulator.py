"""Discrete-event simulation of a fleet: real schedulers, block pools, events, index and policy.

Each replica is the engine's own :class:`~kvroute.replica.core.scheduler.Scheduler` over its own
:class:`~kvroute.replica.core.kv_cache_manager.KVCacheManager` (:mod:`.replica`): the fair queue,
tenant shares, chunked prefill, partial-prefill limits and preemption are the engine's code,
stepped by this simulation's clock. Step times come from :mod:`kvroute.replica.model.cost_model`
for the batch the scheduler produced. After each step the pool's events go out as a real
``EventBatch`` over a per-replica FIFO channel (``event_delay_s``; a batch lost with
probability ``event_loss`` arrives ``recovery_s`` late, as a replay would, and later batches
wait behind it, as the subscriber applies in order) into the real
:class:`~kvroute.router.routing.index.PrefixIndex` that the real policy reads.

Speed (the full Mooncake trace must fit in minutes): blocks are 512 tokens by default (the
trace's own granularity -- it records no finer sharing); segment tokens are generated once;
and a run of pure decode steps that leaves the pool and the queues as they are
(:meth:`~kvroute.replica.core.scheduler.Scheduler.decode_run_after`) is advanced in one event
whose step times are summed in numpy, cut short if a request arrives meanwhile; the block
events and load reports its steps would publish go out at those steps' ends. Results are
per-step exact (up to float rounding of the summed times).

A host KV tier (``host_blocks_per_replica`` or ``host_kv_multiple``): each replica keeps the
blocks its device evicts in a host LRU of that size and loads a prefix found there instead of
recomputing it (:mod:`.host_tier`); its events (``medium="CPU"``) feed the index's lower
tier, and its coefficients report the host link's bandwidth, as a tiered replica's would. A
policy named ``<policy>:nohost`` runs on the same fleet without the tier, so one run sets
tiered and device-only fleets side by side.

LoRA adapters (``lora``): each replica has ``max_loras`` device slots and a host LRU of
adapters, and its scheduler applies the engine's ``max_loras`` rule (:mod:`.lora`); a
request names its adapter, which its blocks' hashes carry; replicas report residency in
their load reports and an adapter's load times in their coefficients. A replica idle while
adapters are read wakes when the first read ends.

P/D disaggregation (``prefill_replicas``, ``decode_replicas``; the rest do both): the
router's own split rule routes each request's prefill to a prefill replica, which hands it
off after its first token with the engine's leases; its decode part is routed among the
replicas that decode and pulls the prompt's blocks over a link (``link_bytes_per_s``,
``link_latency_s``) before it decodes there (:mod:`.disagg`). A fleet without roles runs
none of it.

The fleet's configuration (:class:`SimConfig`, :class:`Fault`) and the names of runs
(:func:`split_policy`, :data:`POOLED`) are :mod:`.config`'s, re-exported here.
"""

from __future__ import annotations

import heapq
import random
from array import array
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvroute.events import MEDIUM_CPU, AllBlocksCleared, BlockHasher, EventBatch
from kvroute.replica.model.cost_model import (
    CostModel,
)
from kvroute.router.routing.index import PrefixIndex, prediction_stride
from kvroute.router.routing.policies import make_policy
from kvroute.router.routing.policy import KVPolicy, Policy, RequestView

from .config import NO_HOST, POLICY_VARIANTS, POOLED, Fault, SimConfig, split_policy
from .disagg import Disagg, Pull
from .door import Door
from .fetch import FETCH, Fetching
from .lora import SimLoRA
from .replica import SimReplica, SimRequest
from .workloads import RequestSpec, TokenSource

__all__ = [
    "NO_HOST",
    "POLICY_VARIANTS",
    "POOLED",
    "Fault",
    "SimConfig",
    "SimReplica",
    "SimRequest",
    "SimRun",
    "split_policy",
]

_ARRIVE, _STEP, _DELIVER, _FAULT, _RUN_STEP, _WAKE, _LAND = 0, 1, 2, 3, 4, 5, 6


class SimRun:
    """One policy's run over one workload (the simulated fleet); :meth:`run` returns it
    with the raw per-request results."""

    def __init__(
        self,
        specs: Sequence[RequestSpec],
        policy_name: str,
        cfg: SimConfig,
        tokens: TokenSource,
        hashes: Sequence[Sequence[bytes]],
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.specs, self.cfg, self.src, self.hashes = specs, cfg, tokens, hashes
        self.progress = progress
        self.hasher = BlockHasher(block_size=cfg.block_size)
        policy, tiered = split_policy(policy_name)
        hosts = [cfg.host_blocks(i) if tiered else 0 for i in range(cfg.replicas)]
        most_blocks = max(cfg.blocks(i) for i in range(cfg.replicas))
        self.index = PrefixIndex(
            max_blocks_per_replica=max(4 * most_blocks, 1024),
            prediction_stride=prediction_stride(cfg.block_size),  # as a front door's
            max_lower_blocks_per_replica=max(2 * max(hosts), 1024),
        )
        self.policy: Policy = make_policy(
            policy, index=self.index, block_size=cfg.block_size, seed=cfg.seed,
            **cfg.kv_params,
        )  # fmt: skip
        self.rng = random.Random(f"loss:{cfg.seed}")
        models = [CostModel(p) for p in cfg.profiles]
        lora = cfg.lora
        times = [lora.times(cfg.profile(i)) if lora else (0.0, 0.0) for i in range(cfg.replicas)]
        self.now = 0.0
        # P/D: its roles and links (None: a fleet without roles, which runs none of it)
        # kv:fetch: every replica may serve and pull a prefix (sim/fetch.py)
        fetch = policy_name.endswith(f":{FETCH}")
        if fetch:
            if not isinstance(self.policy, KVPolicy):
                raise ValueError(f"{policy_name}: only kv policies fetch")
            self.policy.fetchable = lambda r: True
        self.pd = pd = (
            (Fetching if fetch else Disagg)(cfg, cfg.roles(), self._clock)
            if cfg.has_roles or fetch
            else None
        )
        self.reps = [
            SimReplica(
                i, cfg.scheduler_config(i), cfg.blocks(i), self.hasher,
                models[i % len(models)], cfg.fast_decode, hosts[i],
                SimLoRA(lora, *times[i]) if lora else None,
                pd.attach(i) if pd is not None else None,
            )
            for i in range(cfg.replicas)
        ]  # fmt: skip
        # the engines' own limit (the smallest, where profiles differ)
        self.max_model_len = min(rep.scheduler.max_model_len for rep in self.reps)
        for i, rep in enumerate(self.reps):  # what each replica's info carries
            coefficients = models[i % len(models)].coefficients((MEDIUM_CPU,) if hosts[i] else ())
            if lora:  # the load times a LoRA engine measures at start
                coefficients = msgspec.structs.replace(
                    coefficients, lora_load_s=times[i][0], lora_read_s=times[i][1]
                )
            self.policy.load.register(rep.id, coefficients, cfg.blocks(i))
        self._by_id = {rep.id: rep for rep in self.reps}
        self._index_of = {rep.id: i for i, rep in enumerate(self.reps)}
        self.reqs: list[SimRequest | None] = [None] * len(specs)
        self.rejected = self.lost_batches = 0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        if pd is not None:
            pd.run = self
        # Flow control (sim/door.py): None routes every request on arrival.
        self.door = Door(cfg.flow_depth, cfg.flow_tokens) if cfg.flow_depth else None

    def _clock(self) -> float:
        return self.now

    def replica(self, rid: str) -> SimReplica:
        return self._by_id[rid]

    def index_of(self, rid: str) -> int:
        return self._index_of[rid]

    def view(self, req: SimRequest) -> RequestView:
        """What the policy knows of a request (as the front door builds it)."""
        spec = req.spec
        return RequestView(
            req.request_id, spec.input_length, self.hashes[req.idx], self.cfg.block_size,
            req.prompt_token_ids, lora_name=spec.lora_name,
        )  # fmt: skip

    def push_land(self, t: float, pull: Pull) -> None:
        """A P/D pull's blocks are all there at ``t``."""
        self._push(t, _LAND, pull)

    @property
    def preemptions(self) -> int:
        return sum(rep.preemptions for rep in self.reps)

    @property
    def decode_tokens(self) -> int:
        return sum(rep.decode_tokens for rep in self.reps)

    @property
    def adapter_loads(self) -> int:
        """Adapters copied into device slots, fleet-wide."""
        return sum(rep.lora.slot_loads for rep in self.reps if rep.lora is not None)

    @property
    def adapter_reads(self) -> int:
        """Adapters read from disk into host memory, fleet-wide."""
        return sum(rep.lora.reads for rep in self.reps if rep.lora is not None)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    # -- main loop -------------------------------------------------------------------------
    def run(self) -> SimRun:
        for i, spec in enumerate(self.specs):
            self._push(spec.arrival_s, _ARRIVE, i)
        for f in self.cfg.faults:
            self._push(f.time_s, _FAULT, f)
        heap, total, done = self._heap, len(self.specs), 0
        while heap:
            t, _, kind, payload = heapq.heappop(heap)
            self.now = t
            if kind == _STEP:
                rep, version = payload
                if version == rep.version:
                    self._end_step(rep)
            elif kind == _DELIVER:
                rep, epoch, batch, report = payload
                if epoch == rep.epoch and rep.alive:
                    self.index.apply(rep.id, batch)
                    if report is not None:
                        self.policy.load.report(rep.id, report, t)
            elif kind == _RUN_STEP:
                self._run_step(*payload)
            elif kind == _WAKE:
                rep, epoch = payload
                if epoch == rep.epoch and rep.alive and not rep.busy:
                    self._start_step(rep)
            elif kind == _LAND:
                assert self.pd is not None
                self.pd.arrived(payload)
            elif kind == _ARRIVE:
                self._arrive(payload)
                done += 1
                if self.progress is not None and (done & 255 == 0 or done == total):
                    self.progress(done, total)
            else:
                self._fault(payload)
        return self

    def _arrive(self, i: int, first_s: float | None = None) -> None:
        spec = self.specs[i]
        bs = self.cfg.block_size
        toks = array("I")
        toks.frombytes(self.src.prompt_bytes(spec))
        req = self.reqs[i] = SimRequest(i, spec, toks, self.now, self.cfg.fair_share)
        req.first_s = first_s  # a retry: the client has its first token already
        if spec.input_length + spec.output_length > self.max_model_len:
            # Beyond the engines' context (the model's, or the whole cache): refused at the
            # door, as vLLM refuses a prompt plus max_tokens beyond max_model_len.
            self.rejected += 1
            req.release()
            return
        view = RequestView(
            req.request_id, spec.input_length, self.hashes[i], bs, toks, lora_name=spec.lora_name
        )
        door = self.door
        # With flow control, behind those already waiting (first come, first served), or at
        # the door when no replica it may go to has room.
        if door is not None and (door.waiting or not self._send(req, view)):
            door.waiting.append((req, view))
            door.num_waited += 1
        elif door is None:
            self._send(req, view)

    def _send(self, req: SimRequest, view: RequestView) -> bool:
        """Routes ``req`` and hands it to its replica; False (nothing done) when flow
        control holds it at the door: no replica it may go to has room."""
        alive = [r.id for r in self.reps if r.alive]
        if self.pd is not None:  # P/D: the router's plan says which replicas may take it
            alive = self.pd.candidates(req, view, alive, self.now)
        door = self.door
        if door is not None and alive:
            alive = door.room(alive)
            if not alive:
                return False
        decision = self.policy.route(view, alive, self.now)
        if decision.fetch_from is not None and isinstance(self.pd, Fetching):
            self.pd.fetch(req, decision, self.now)
        rep = self._by_id[decision.replica]
        req.replica = self._index_of[decision.replica]
        rep.routed += 1
        if door is not None:
            door.occupy(req.idx, rep.id, req.spec.input_length)
        rep.inbox.append(req)
        self.kick(rep)
        return True

    def _open_door(self) -> None:
        """Slots were given back: the waiting requests go, in order, while there is room."""
        door = self.door
        assert door is not None
        while door.waiting:
            req, view = door.waiting[0]
            if not self._send(req, view):
                return
            door.waiting.popleft()

    def kick(self, rep: SimReplica) -> None:
        """Something reached ``rep`` (its inbox, a P/D pull's blocks): an idle replica steps
        now, one in a run of decode steps at the end of the step in progress (the next step
        sees it)."""
        if not rep.busy:
            self._start_step(rep)
        elif rep.run is not None:
            end = rep.cut_run(self.now)
            if end is not None:
                self._push(end, _STEP, (rep, rep.version))

    # -- the engines -----------------------------------------------------------------------
    def _start_step(self, rep: SimReplica) -> None:
        dt = rep.start_step(self.now)
        if dt is not None:
            self._push(self.now + dt, _STEP, (rep, rep.version))
            if rep.run is not None:
                self._next_run_step(rep, 0)
        elif rep.lora is not None and rep.lora.reading:  # idle until an adapter is read
            end = rep.lora.next_read_end()
            if end is not None:
                self._push(max(end, self.now), _WAKE, (rep, rep.epoch))

    def _next_run_step(self, rep: SimReplica, done: int) -> None:
        """The next step of the run in flight, after step ``done``, whose end publishes
        something (the first step's block events; a load report when one is due): an event
        at its end. The run's last step is its own end event's."""
        run = rep.run
        assert run is not None
        ends, last, interval = run.ends, rep.last_report, self.cfg.report_interval_s
        j = done + 1
        if not (j == 1 and run.events):
            j = max(j, bisect_left(ends, last + interval, hi=run.steps))  # one early: rounding
            while j < run.steps and ends[j - 1] - last < interval:  # _publish's own test
                j += 1
        if j < run.steps:
            self._push(ends[j - 1], _RUN_STEP, (rep, run.id, j))

    def _run_step(self, rep: SimReplica, run_id: int, j: int) -> None:
        run = rep.run
        if run is None or run.id != run_id or j >= run.steps:
            return  # the run was cut short (its end publishes), or the replica failed
        self._publish(rep, run_steps=j)
        self._next_run_step(rep, j)

    def _end_step(self, rep: SimReplica) -> None:
        now, policy = self.now, self.policy
        first, finished = rep.end_step()
        door, moved = self.door, False
        for r in first:
            if r.resumed:  # a P/D decode part's first token there (the client had one)
                r.resumed = False
            else:
                r.first_s = now
            policy.on_first_token(r.request_id, now)
            if door is not None:
                moved |= door.vacate(r.idx)
        for r in finished:
            r.done_s = now
            r.release()
            policy.on_finished(r.request_id, now, r.num_output_tokens)
            if door is not None:
                moved |= door.vacate(r.idx)
        if rep.handoffs:
            assert self.pd is not None
            self.pd.hand_off(rep)
        self._publish(rep)
        rep.run = None
        self._start_step(rep)
        if moved:  # after this replica's next step is set: sending may kick it
            self._open_door()

    def _publish(self, rep: SimReplica, events: list | None = None, run_steps: int = 0) -> None:
        """After a step (the ``run_steps``-th of a run in flight): its events, and a load
        report when one is due (one per interval, riding on the event stream; an empty batch
        carries it when the step stored nothing, as a live replica's heartbeat would)."""
        events = rep.take_events() if events is None else events
        report = None
        if self.now - rep.last_report >= self.cfg.report_interval_s:
            rep.last_report = self.now
            report = rep.load_report(run_steps)  # as a live one does
        if not events and report is None:
            return
        t = self.now + self.cfg.event_delay_s
        if self.cfg.event_loss and self.rng.random() < self.cfg.event_loss:
            t += self.cfg.recovery_s
            self.lost_batches += 1
        t = rep.last_deliver = max(t, rep.last_deliver)
        self._push(t, _DELIVER, (rep, rep.epoch, EventBatch(self.now, events), report))

    # -- faults ----------------------------------------------------------------------------
    def _fault(self, f: Fault) -> None:
        rep = self.reps[f.replica]
        if f.kind == "up":
            if not rep.alive:
                rep.crash()  # a fresh, empty engine
                rep.alive = True
                rep.epoch += 1
                if self.door is not None:
                    self._open_door()  # room again
            return
        if f.kind not in ("restart", "down"):
            raise ValueError(f"unknown fault kind {f.kind!r}")
        if not rep.alive:
            return
        lost = self.pd.drop(rep) if self.pd is not None else []  # waiting for pulls
        orphans = rep.crash() + lost
        for r in orphans:
            self.policy.on_finished(r.request_id, self.now)
            if self.door is not None:
                self.door.vacate(r.idx)
        if f.kind == "down":
            rep.alive = False
            rep.epoch += 1  # stop its subscription; in-flight batches are dropped
            self.policy.on_replica_removed(rep.id)
        else:  # seq restarts at 0: the subscriber turns that into a clear of the replica
            self._publish(rep, [AllBlocksCleared()])
        for r in orphans:  # the front door retries them from scratch
            self._arrive(r.idx, r.first_s)
        if self.door is not None:
            self._open_door()
