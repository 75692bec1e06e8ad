"""Runs of pure decode steps advanced at once (the simulator's fast path) leave the scheduler,
its queues, its tenant counters and its KV cache exactly as step-by-step scheduling does.

Two schedulers are fed the same requests in lockstep; whenever ``decode_run_after`` promises a
run after the step just scheduled, one takes it step by step (and each of those steps must be
the promised batch: every running request, one token each, nothing admitted or preempted),
the other in one ``advance_decode_run`` call; then their whole states (block events
included) must agree, and they go on together.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvroute.events import BlockHasher
from kvroute.events.replica_api import SamplingParams
from kvroute.replica.core.kv_cache_manager import KVCacheManager
from kvroute.replica.core.request import Request
from kvroute.replica.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 16


def make(num_blocks: int, **cfg: Any) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, BlockHasher(block_size=BS)))


def state(s: Scheduler) -> tuple:
    kv = s.kv_cache_manager
    reqs = {
        rid: (r.status, r.num_computed_tokens, list(r.all_token_ids), r.num_preemptions)
        for rid, r in s.requests.items()
    }
    tenants = {r.tenant for r in s.requests.values()}
    return (
        reqs,
        [r.request_id for r in s.running],
        [r.request_id for r in s.waiting],  # ring order and each tenant's order
        sorted(s.finished_req_ids),
        {t: (s.usage.count(t), s.usage.live(t)) for t in tenants},
        kv.get_num_free_blocks(),
        {rid: list(ids) for rid, ids in kv.req_to_block_ids.items()},
        dict(kv.num_cached_block),
        kv.block_pool.cached_hash_counts(),
        (kv.prefix_cache_queries, kv.prefix_cache_hits),
        kv.take_events(),
    )


def update(s: Scheduler, out: SchedulerOutput) -> None:
    s.update_from_output(out, {x.request.request_id: 0 for x in out.scheduled if x.samples})


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    update(s, out)
    return out


CONFIGS = {
    "roomy": dict(num_blocks=400, max_num_batched_tokens=256),
    "tight memory": dict(num_blocks=40, max_num_batched_tokens=256),
    "few seqs": dict(num_blocks=400, max_num_batched_tokens=256, max_num_seqs=3),
    "threshold + partial": dict(
        num_blocks=120,
        max_num_batched_tokens=128,
        long_prefill_token_threshold=40,
        max_num_partial_prefills=1,
        attention_weight=0.01,
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_bulk_advance_equals_step_by_step(name: str) -> None:
    cfg = dict(CONFIGS[name])
    a, b = make(**cfg), make(**cfg)
    rng = random.Random(name)
    shared = [rng.randrange(1000) for _ in range(5 * BS)]  # a prefix some prompts share
    runs = runs_with_waiting = bulk_steps = 0
    next_id = 0
    for _ in range(700):
        if rng.random() < 0.15 and next_id < 120:
            n = rng.randrange(1, 6 * BS)
            prompt = shared[: rng.randrange(0, len(shared))] if rng.random() < 0.5 else []
            prompt = prompt + [rng.randrange(1000) for _ in range(n)]
            tenant = rng.choice(["t0", "t1", "t2", None])
            max_tokens = rng.randrange(1, 80)
            for s in (a, b):
                sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                s.add_request(Request(f"r{next_id}", prompt, sp, tenant=tenant, arrival_time=0.0))
            next_id += 1
        out_a, out_b = a.schedule(), b.schedule()
        k = a.decode_run_after(out_a)
        assert k == b.decode_run_after(out_b)
        update(a, out_a)
        update(b, out_b)
        if k >= 1:
            m = rng.randrange(1, k + 1)  # a run may be cut short by an arrival
            running = [r.request_id for r in a.running]
            runs += 1
            runs_with_waiting += bool(a.waiting)
            bulk_steps += m
            for _ in range(m):
                out = step(a)
                assert [x.request.request_id for x in out.scheduled] == running
                assert all(x.num_new_tokens == 1 and x.samples for x in out.scheduled)
                assert not out.preempted_request_ids
            finished = b.advance_decode_run(m)
            assert [r.request_id for r in finished] == sorted(a.finished_req_ids, key=running.index)
        assert state(a) == state(b)
    assert runs > 20 and bulk_steps > 2 * runs  # the fast path was exercised, and in bulk
    if name in ("tight memory", "few seqs"):
        assert runs_with_waiting >= 5, (
            runs_with_waiting
        )  # runs while admission is blocked, not only idle queues


def test_no_run_when_a_token_could_stop_a_request() -> None:
    s = make(100)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=50), eos_token_id=7))
    step(s)
    assert s.decode_run_after(s.schedule()) == 0  # what it samples decides if it goes on
    s = make(100)
    s.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), 7))
    step(s)
    # position 3 scheduled; the run: positions 4..15, the last filling block 0
    assert s.decode_run_after(s.schedule()) == BS - 4
