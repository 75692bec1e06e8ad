"""The simulator runs the engine's own scheduler: the same request stream gives the same
schedule as a plain engine loop over a :class:`Scheduler`, and what only the engine's
scheduler does (fair queue, tenant shares, partial-prefill limits) shows up in simulations."""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable

import numpy as np
import pytest

from kvroute.events import BlockHasher
from kvroute.replica.core.kv_cache_manager import KVCacheManager
from kvroute.replica.core.scheduler import Scheduler, SchedulerOutput
from kvroute.replica.model.cost_model import CostModel
from kvroute.sim.replica import SimRequest
from kvroute.sim.report import router_hashes
from kvroute.sim.simulator import SimConfig, SimRun
from kvroute.sim.workloads import RequestSpec, TokenSource, make_workload

Step = tuple[float, list[tuple[str, int, int]], list[str]]  # start, (id, p0, n), preempted


def batch(now: float, out: SchedulerOutput) -> Step:
    items = [(x.request.request_id, x.num_computed_tokens, x.num_new_tokens) for x in out.scheduled]
    return now, items, list(out.preempted_request_ids)


def engine_loop(specs: list[RequestSpec], cfg: SimConfig) -> tuple[list[Step], dict[str, tuple]]:
    """What an engine thread does, on a virtual clock: between steps it takes the requests
    that arrived, then schedules, runs the batch for its modelled time, applies the tokens."""
    sched = Scheduler(
        cfg.scheduler_config(), KVCacheManager(cfg.blocks(), BlockHasher(block_size=cfg.block_size))
    )
    cost, src = CostModel(cfg.profile()), TokenSource()
    arrivals = list(enumerate(specs))[::-1]
    steps: list[Step] = []
    times: dict[str, tuple] = {}
    now = 0.0
    while arrivals or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            now = max(now, arrivals[-1][1].arrival_s)  # idle until the next request
        while arrivals and arrivals[-1][1].arrival_s <= now:
            i, spec = arrivals.pop()
            toks = array("I")
            toks.frombytes(src.prompt_bytes(spec))
            sched.add_request(SimRequest(i, spec, toks, spec.arrival_s))
        out = sched.schedule()
        steps.append(batch(now, out))
        tokens = ctx = 0
        pairs = 0.0
        for x in out.scheduled:
            n, p0 = x.num_new_tokens, x.num_computed_tokens
            tokens, pairs, ctx = tokens + n, pairs + n * p0 + n * (n - 1) / 2, ctx + p0 + n
        now += cost.step_time(tokens, pairs, ctx)
        for req in sched.update_from_output(out, {x.request.request_id: 0 for x in out.scheduled}):
            if req.num_output_tokens == 1:
                times[req.request_id] = (now,)
            if req.is_finished:
                times[req.request_id] += (now,)
    return steps, times


def simulate_one(specs: list[RequestSpec], cfg: SimConfig) -> tuple[SimRun, list[Step]]:
    """One replica; every step the simulator's scheduler makes, recorded."""
    src = TokenSource()
    fleet = SimRun(specs, "round_robin", cfg, src, router_hashes(specs, cfg, src))
    steps: list[Step] = []
    rep = fleet.reps[0]
    schedule = rep.scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        steps.append(batch(fleet.now, out))
        return out

    rep.scheduler.schedule = recorded  # type: ignore[method-assign]
    return fleet.run(), steps


def contended() -> tuple[list[RequestSpec], SimConfig]:
    """Three tenants on one small replica: chunked prefill, tenant shares, preemptions."""
    specs = [
        RequestSpec(s.arrival_s, s.segments, s.output_length, f"t{i % 3}")
        for i, s in enumerate(make_workload("tenants", 90, seed=1, speed=6.0))
    ]
    assert len({s.arrival_s for s in specs}) == len(specs)  # no ties: one order of events
    cfg = SimConfig(replicas=1, block_size=64, blocks_per_replica=420, report_interval_s=1e9)
    return specs, cfg


def test_simulator_makes_the_engine_loops_schedule_step_for_step() -> None:
    specs, cfg = contended()
    ref_steps, ref_times = engine_loop(specs, cfg)
    cfg.fast_decode = False
    fleet, steps = simulate_one(specs, cfg)
    assert sum(len(p) for _, _, p in ref_steps) > 5  # preemptions happened
    assert sum(len(b) > 1 and b[-1][2] > 1 for _, b, _ in ref_steps) > 5  # mixed batches
    assert len(steps) == len(ref_steps)
    for (t, b, p), (rt, rb, rp) in zip(steps, ref_steps, strict=True):
        assert (b, p) == (rb, rp)
        assert t == pytest.approx(rt, rel=1e-12, abs=1e-12)
    for req in fleet.reqs:
        assert req is not None
        assert (req.first_s, req.done_s) == pytest.approx(ref_times[req.request_id], rel=1e-12)


def test_with_the_fast_path_the_same_requests_end_at_the_same_times() -> None:
    specs, cfg = contended()
    _, ref_times = engine_loop(specs, cfg)
    fleet, steps = simulate_one(specs, cfg)
    ref_steps, _ = engine_loop(specs, cfg)
    order = sorted(ref_times, key=lambda rid: ref_times[rid][1])
    got = {r.request_id: (r.first_s, r.done_s) for r in fleet.reqs if r is not None}
    assert sorted(got, key=lambda rid: got[rid][1]) == order
    for rid, t in ref_times.items():
        assert got[rid] == pytest.approx(t, rel=1e-9)
    assert len(steps) < 0.5 * len(ref_steps)  # most steps were advanced in runs


def flood(light_arrivals: list[float]) -> list[RequestSpec]:
    """A tenant queues 150 prompts of 4,096 tokens in 0.75 s; another sends short ones."""
    heavy = [RequestSpec(0.005 * i, ((10_000 + i, 4096),), 32, "flood") for i in range(150)]
    light = [
        RequestSpec(t, ((20_000 + i, 256),), 16, "light") for i, t in enumerate(light_arrivals)
    ]
    return sorted(heavy + light, key=lambda s: s.arrival_s)


def ttfts(fleet: SimRun, tenant: str) -> np.ndarray:
    return np.array([
        r.first_s - r.spec.arrival_s for r in fleet.reqs
        if r is not None and r.spec.cache_salt == tenant and r.first_s is not None
    ])  # fmt: skip


def test_a_light_tenant_gets_its_share_while_another_floods() -> None:
    """FCFS (the simulator's old loop) put the light tenant's requests behind the whole
    flood (~30 s); the engine's fair queue and shares serve them within a step or two."""
    specs = flood([1.0 + 0.5 * i for i in range(8)])
    src = TokenSource()
    cfg = SimConfig(replicas=1, block_size=64)
    fleet = SimRun(specs, "round_robin", cfg, src, router_hashes(specs, cfg, src)).run()
    light, heavy = ttfts(fleet, "light"), ttfts(fleet, "flood")
    assert len(light) == 8 and len(heavy) == 150
    assert np.median(heavy) > 10.0  # the replica is swamped
    assert light.max() < 1.0, light


def test_partial_prefill_limits_reach_the_simulated_engines() -> None:
    specs = flood([1.0, 1.5])
    cfg = SimConfig(replicas=1, block_size=64, long_prefill_token_threshold=512)
    chunks: dict[int, list[list[tuple[str, int]]]] = {}
    for limit in (0, 1):
        cfg.max_num_partial_prefills = limit
        _, steps = simulate_one(specs, cfg)
        spec = {f"r{i}": s for i, s in enumerate(specs)}
        # per step: the prompt chunks that leave their request part-way, with the tenant
        chunks[limit] = [
            [(spec[rid].cache_salt, n) for rid, p0, n in b if p0 + n < spec[rid].input_length]
            for _, b, _ in steps
        ]
    for limit, per_step in chunks.items():
        assert all(n <= 512 for step in per_step for _, n in step)  # the threshold binds
        most = max(sum(t == "flood" for t, _ in step) for step in per_step)
        assert most == 1 if limit else most > 1  # one flood prompt part-way at a time


def test_the_scheduler_reads_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock-agnostic core: a whole simulated run, schedulers and all, on the fleet's
    virtual time only (time enters as each request's arrival_time)."""
    specs, cfg = contended()
    src = TokenSource()
    fleet = SimRun(specs[:30], "kv", cfg, src, router_hashes(specs[:30], cfg, src))

    here = threading.current_thread()

    def no_clock(real: Callable[[], float]) -> Callable[[], float]:
        """The clock for this thread raises; other threads (a background writer left by an
        earlier test, Ray's, ZeroMQ's) keep theirs and are not crashed by this test."""

        def read() -> float:
            if threading.current_thread() is here:
                raise AssertionError("wall clock read")
            return real()

        return read

    for name in ("time", "monotonic", "perf_counter", "monotonic_ns", "time_ns"):
        monkeypatch.setattr(time, name, no_clock(getattr(time, name)))
    fleet.run()
    monkeypatch.undo()
    assert all(r is not None and r.done_s is not None for r in fleet.reqs)
    assert all(r.arrival_time == r.spec.arrival_s for r in fleet.reqs)  # type: ignore[union-attr]
