"""Discrete-event simulation of a fleet: real block pools, real events, real index and policy.

Each replica is the engine's own :class:`~kvroute.replica.kv_cache_manager.KVCacheManager`
(real hashing, hits, lazy-LRU eviction) under a vLLM-V1-like scheduler: running requests
first (a decode token each, or their next prefill chunk), then waiting ones FCFS while the
token budget, ``max_num_seqs`` and free blocks allow; when a running request needs a block
and none is free, the most recently admitted one is preempted (freed, recomputed later).
Step times come from :mod:`kvroute.replica.cost_model`. After each step the pool's events go
out as a real ``EventBatch`` over a per-replica FIFO channel (``event_delay_s``; a batch lost
with probability ``event_loss`` arrives ``recovery_s`` late, as a replay would, and later
batches wait behind it, as the subscriber applies in order) into the real
:class:`~kvroute.router.index.PrefixIndex` that the real policy reads.

Speed (the full Mooncake trace must fit in minutes): blocks are 512 tokens by default (the
trace's own granularity -- it records no finer sharing); segment tokens are generated once;
and a run of pure decode steps in which no request needs its manager (no block filled or
allocated: the manager would be a no-op) is advanced in one event whose step times are
summed in numpy, cut short if a request arrives meanwhile. Results are per-step exact.
"""

from __future__ import annotations

import heapq
import random
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute.events import AllBlocksCleared, BlockHasher, EventBatch
from kvroute.replica.cost_model import H100_8B, CostModel, Profile
from kvroute.replica.kv_cache_manager import KVCacheManager
from kvroute.replica.scheduler import load_report
from kvroute.router.index import PrefixIndex, prediction_stride
from kvroute.router.policy import Policy, RequestView, make_policy

from .workloads import RequestSpec, TokenSource

_ARRIVE, _STEP, _DELIVER, _FAULT = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class Fault:
    time_s: float
    replica: int
    kind: str  # "restart" (cache lost, comes back at once), "down", "up"


@dataclass(slots=True)
class SimConfig:
    replicas: int = 8
    blocks_per_replica: int | None = None  # None: the profile's KV capacity
    block_size: int = 512
    profile: Profile = H100_8B
    event_delay_s: float = 0.005
    event_loss: float = 0.0
    recovery_s: float = 0.5
    report_interval_s: float = 0.1
    seed: int = 0
    kv_params: dict[str, float] = field(default_factory=dict)
    faults: tuple[Fault, ...] = ()
    fast_decode: bool = True  # advance runs of pure decode steps in one event (exact)

    @property
    def blocks(self) -> int:
        if self.blocks_per_replica is not None:
            return self.blocks_per_replica
        return self.profile.kv_tokens // self.block_size


class SimRequest:
    """A request inside one run; satisfies the KVCacheManager's CacheRequest protocol."""

    __slots__ = (
        "cache_salt", "done_s", "first_s", "generated", "hit", "idx", "lora_name",
        "num_computed_tokens", "num_tokens", "output_len", "prompt_len", "replica",
        "request_id", "spec", "tokens",
    )  # fmt: skip

    def __init__(self, idx: int, spec: RequestSpec, tokens: array) -> None:
        self.idx, self.spec, self.tokens = idx, spec, tokens
        self.request_id = f"r{idx}"
        self.cache_salt, self.lora_name = spec.cache_salt, None
        self.prompt_len = spec.input_length
        self.output_len = spec.output_length
        self.reset()
        self.hit: int | None = None  # tokens hit at first admission
        self.first_s: float | None = None
        self.done_s: float | None = None
        self.replica = -1

    def reset(self) -> None:
        self.num_tokens, self.num_computed_tokens, self.generated = self.prompt_len, 0, 0

    @property
    def num_output_tokens(self) -> int:
        return self.generated

    @property
    def all_token_ids(self) -> array:
        return self.tokens[: self.num_tokens]


class _SimEngine:
    """One simulated replica: its engine's queues and KV cache manager, the step in flight,
    and what it computed."""

    __slots__ = (
        "alive", "busy_s", "decode_tokens", "epoch", "id", "kv", "last_deliver", "last_report",
        "macro", "prefill_tokens", "routed", "running", "step", "version", "waiting",
    )  # fmt: skip

    def __init__(self, i: int, kv: KVCacheManager) -> None:
        self.id, self.kv = f"replica-{i}", kv
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.step: list[tuple[SimRequest, int, bool]] | None = None  # a normal step in flight
        self.macro: tuple[float, np.ndarray, int] | None = None  # (start, cum times, steps)
        self.version = self.epoch = self.routed = self.prefill_tokens = self.decode_tokens = 0
        self.busy_s, self.last_deliver, self.last_report = 0.0, 0.0, -1.0
        self.alive = True


class Fleet:
    """One policy's run over one workload; :meth:`run` returns the raw per-request results."""

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
        self.cm = CostModel(cfg.profile)
        self.hasher = BlockHasher(block_size=cfg.block_size)
        self.index = PrefixIndex(
            max_blocks_per_replica=max(4 * cfg.blocks, 1024),
            prediction_stride=prediction_stride(cfg.block_size),  # as a front door's
        )
        self.policy: Policy = make_policy(
            policy_name, index=self.index, block_size=cfg.block_size, seed=cfg.seed,
            **cfg.kv_params,
        )  # fmt: skip
        self.rng = random.Random(f"loss:{cfg.seed}")
        self.reps = [_SimEngine(i, self._new_kv()) for i in range(cfg.replicas)]
        coefficients = self.cm.coefficients()  # what each replica's info carries
        for rep in self.reps:
            self.policy.load.register(rep.id, coefficients, cfg.blocks)
        self._by_id = {rep.id: rep for rep in self.reps}
        self._index_of = {rep.id: i for i, rep in enumerate(self.reps)}
        self.reqs: list[SimRequest | None] = [None] * len(specs)
        self.rejected = self.preemptions = self.decode_tokens = self.lost_batches = 0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.now = 0.0

    def _new_kv(self) -> KVCacheManager:
        return KVCacheManager(self.cfg.blocks, self.hasher)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    # -- main loop -------------------------------------------------------------------------
    def run(self) -> Fleet:
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
            elif kind == _ARRIVE:
                self._arrive(payload)
                done += 1
                if self.progress is not None and (done & 255 == 0 or done == total):
                    self.progress(done, total)
            else:
                self._fault(payload)
        return self

    def _arrive(self, i: int, retry: SimRequest | None = None) -> None:
        spec = self.specs[i]
        req = retry
        if req is None:
            toks = array("I")
            toks.frombytes(self.src.prompt_bytes(spec))
            toks.frombytes(bytes(4 * spec.output_length))  # output: zeros, unique by chain
            req = self.reqs[i] = SimRequest(i, spec, toks)
        bs = self.cfg.block_size
        if -(-(req.prompt_len + req.output_len) // bs) > self.cfg.blocks:
            self.rejected += 1  # longer than the whole cache: the engine would refuse it
            req.tokens = array("I")
            return
        alive = [r.id for r in self.reps if r.alive]
        view = RequestView(req.request_id, req.prompt_len, self.hashes[i], bs,
                           req.tokens[: req.prompt_len])  # fmt: skip
        decision = self.policy.route(view, alive, self.now)
        rep = self._by_id[decision.replica]
        req.replica = self._index_of[decision.replica]
        rep.routed += 1
        rep.waiting.append(req)
        self._kick(rep)

    def _kick(self, rep: _SimEngine) -> None:
        """New work for ``rep``: start a step if idle, or cut a decode run short."""
        if rep.step is None and rep.macro is None:
            self._start_step(rep)
        elif rep.macro is not None:
            t0, cum, k = rep.macro
            m = min(int(np.searchsorted(cum, self.now - t0, side="left")) + 1, k)
            if m < k:
                rep.macro = (t0, cum, m)
                rep.version += 1
                self._push(t0 + float(cum[m - 1]), _STEP, (rep, rep.version))

    # -- the engine ------------------------------------------------------------------------
    def _start_step(self, rep: _SimEngine) -> None:
        running, waiting, kv = rep.running, rep.waiting, rep.kv
        if not running and not waiting:
            return
        bs = self.cfg.block_size
        if not waiting and running and self.cfg.fast_decode and self._try_macro(rep):
            return
        budget = self.cfg.profile.max_batched_tokens
        sched: list[tuple[SimRequest, int, bool]] = []
        tokens = ctx = 0
        pairs = 0.0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            p0 = r.num_computed_tokens
            n = min(r.num_tokens - p0, budget)
            decode = r.generated > 0 and r.num_tokens - p0 == 1
            total = p0 + n
            if not decode or total % bs in (0, 1 % bs):  # else the manager is a no-op
                while kv.allocate_slots(r, n) is None:
                    victim = running.pop()  # the most recently admitted, never one scheduled
                    self._preempt(rep, victim)
                    preempted = True
                    if victim is r:
                        break
                if i >= len(running):
                    break  # r itself was preempted
            sched.append((r, n, decode))
            tokens += n
            pairs += n * p0 + n * (n - 1) / 2
            ctx += total
            budget -= n
            i += 1
        while waiting and budget > 0 and not preempted:
            if len(running) >= self.cfg.profile.max_num_seqs:
                break
            r = waiting[0]
            blocks, hit = kv.get_computed_blocks(r)
            n = min(r.num_tokens - hit, budget)
            if kv.allocate_slots(r, n, hit, blocks) is None:
                break
            waiting.popleft()
            if r.hit is None:
                r.hit = hit
            r.num_computed_tokens = hit
            running.append(r)
            sched.append((r, n, False))
            tokens += n
            pairs += n * hit + n * (n - 1) / 2
            ctx += hit + n
            budget -= n
        if not sched:
            return  # nothing fits: a finishing request will kick this replica again
        dt = self.cm.step_time(tokens, pairs, ctx)
        rep.step = sched
        rep.busy_s += dt
        rep.version += 1
        self._push(self.now + dt, _STEP, (rep, rep.version))

    def _preempt(self, rep: _SimEngine, victim: SimRequest) -> None:
        rep.kv.free(victim)
        victim.num_computed_tokens = 0
        rep.waiting.appendleft(victim)
        self.preemptions += 1

    def _try_macro(self, rep: _SimEngine) -> bool:
        """Pure decode, no manager calls due: advance several steps in one event."""
        bs, k, pos = self.cfg.block_size, 1 << 30, 0
        for r in rep.running:
            p0 = r.num_computed_tokens
            if r.generated == 0 or r.num_tokens - p0 != 1:
                return False
            x = (p0 + 1) % bs
            k = min(k, r.output_len - r.generated, 0 if x in (0, 1 % bs) else bs - x)
            pos += p0
        if k < 2:
            return False
        cum = self.cm.decode_run(len(rep.running), pos, k)
        rep.macro = (self.now, cum, k)
        rep.version += 1
        self._push(self.now + float(cum[-1]), _STEP, (rep, rep.version))
        return True

    def _end_step(self, rep: _SimEngine) -> None:
        now, policy = self.now, self.policy
        finished: list[SimRequest] = []
        if rep.macro is not None:
            _, cum, m = rep.macro
            rep.macro = None
            rep.busy_s += float(cum[m - 1])
            for r in rep.running:
                r.num_computed_tokens += m
                r.generated += m
                r.num_tokens += m
                if r.generated >= r.output_len:
                    finished.append(r)
            self.decode_tokens += m * len(rep.running)
            rep.decode_tokens += m * len(rep.running)
        else:
            sched, rep.step = rep.step or [], None
            for r, n, decode in sched:
                r.num_computed_tokens += n
                if decode:
                    self.decode_tokens += 1
                    rep.decode_tokens += 1
                else:
                    rep.prefill_tokens += n
                if r.num_computed_tokens < r.num_tokens:
                    continue
                r.generated += 1
                if r.first_s is None:
                    r.first_s = now
                    policy.on_first_token(r.request_id, now)
                if r.generated >= r.output_len:
                    finished.append(r)
                else:
                    r.num_tokens += 1
        if finished:
            gone = set(map(id, finished))
            rep.running = [r for r in rep.running if id(r) not in gone]
            for r in finished:
                rep.kv.free(r)
                r.done_s = now
                r.tokens = array("I")  # release the token buffer
                policy.on_finished(r.request_id, now, r.generated)
        self._publish(rep)
        self._start_step(rep)

    def _publish(self, rep: _SimEngine, events: list | None = None) -> None:
        """After a step: its events, and a load report when one is due (one per interval,
        riding on the event stream; an empty batch carries it when the step stored nothing,
        as a live replica's heartbeat would)."""
        events = rep.kv.take_events() if events is None else events
        report = None
        if self.now - rep.last_report >= self.cfg.report_interval_s:
            rep.last_report = self.now
            report = load_report(rep.waiting, rep.running, rep.kv)  # as a live one does
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
                rep.alive, rep.kv = True, self._new_kv()
                rep.epoch += 1
            return
        if f.kind not in ("restart", "down"):
            raise ValueError(f"unknown fault kind {f.kind!r}")
        if not rep.alive:
            return
        orphans = [*rep.running, *rep.waiting]
        rep.running, rep.waiting = [], deque()
        rep.step = rep.macro = None
        rep.version += 1
        rep.kv = self._new_kv()  # the engine process is gone: a fresh, empty pool
        for r in orphans:
            self.policy.on_finished(r.request_id, self.now)
        if f.kind == "down":
            rep.alive = False
            rep.epoch += 1  # stop its subscription; in-flight batches are dropped
            self.policy.on_replica_removed(rep.id)
        else:  # seq restarts at 0: the subscriber turns that into a clear of the replica
            self._publish(rep, [AllBlocksCleared()])
        for r in orphans:  # the front door retries them from scratch
            r.reset()
            r.hit = None
            self._arrive(r.idx, retry=r)
