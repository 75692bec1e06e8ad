"""Scheduler: token budget, chunked prefill, preemption by recompute, prefix hits, aborts.

The model is a fake with a fake paged KV cache: the "KV" written at position p is a rolling
hash of the request's tokens [0, p], and the next token is derived from the KV *read back*
through the block table at the last position. So a wrong block table, a prefix hit on the
wrong blocks or a bad recompute after preemption changes the output (and trips the
read-back check), while a correct scheduler makes a request's output a function of its
tokens alone, whatever the cache size, budget or interleaving.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvroute.events.replica_api import SamplingParams
from kvroute.replica.core.request import Request, RequestStatus
from kvroute.replica.core.scheduler import (
    RequestTooLongError,
    SchedulerOutput,
)

from ..scheduling import FakeRunner, Harness, prompt, reference, scheduled_ids


# -- budget and chunked prefill -------------------------------------------------------------
def test_budget_respected_and_outputs_independent_of_budget() -> None:
    prompts = {f"r{i}": prompt(i, 3 + 11 * i % 40) for i in range(12)}
    results = []
    for budget in (1, 7, 64, 2048):
        h = Harness(200, max_num_batched_tokens=budget)
        for rid, p in prompts.items():
            h.add(rid, p, max_tokens=9)
        h.run_all()
        results.append({rid: r.output_token_ids for rid, r in h.done.items()})
        partial = [x for o in h.history for x in o.scheduled if not x.samples]
        assert bool(partial) == (budget < sum(map(len, prompts.values())))
    sp = SamplingParams(max_tokens=9)
    assert results[0] == {rid: reference(p, sp, None, 8192) for rid, p in prompts.items()}
    assert all(r == results[0] for r in results)


def test_chunked_prefill_spreads_while_others_decode() -> None:
    h = Harness(100, max_num_batched_tokens=16)
    h.add("a", prompt(1, 5), max_tokens=50)
    h.add("b", prompt(2, 6), max_tokens=50)
    h.step()
    h.add("long", prompt(3, 100), max_tokens=3)
    chunks = []
    while not h.sched.requests["long"].output_token_ids:
        sched = scheduled_ids(h.step())
        assert sched["a"].num_new_tokens == sched["b"].num_new_tokens == 1  # decodes go on
        chunks.append(sched["long"].num_new_tokens)
    assert chunks == [14] * 7 + [2]  # 100 tokens in 8 steps, 14 = 16 - 2 decodes
    h.run_all()
    assert h.done["long"].output_token_ids == reference(
        prompt(3, 100), SamplingParams(max_tokens=3), None, 8192
    )


def test_long_prefill_token_threshold_caps_one_chunk() -> None:
    h = Harness(100, max_num_batched_tokens=64, long_prefill_token_threshold=10)
    h.add("long", prompt(1, 30), max_tokens=2)
    h.add("short", prompt(2, 8), max_tokens=2)
    out = scheduled_ids(h.step())
    assert out["long"].num_new_tokens == 10 and out["short"].num_new_tokens == 8
    assert scheduled_ids(h.step())["long"].num_new_tokens == 10
    h.run_all()


def test_threshold_counted_in_cost_shortens_chunks_deep_in_a_prompt() -> None:
    """With an attention weight, each chunk costs at most what ``threshold`` tokens cost at a
    prompt's start (n + w * pairs), so chunks shrink as the context grows; the output is
    the same as without the weight."""
    t, w = 10, 0.05
    h = Harness(200, max_num_batched_tokens=64, long_prefill_token_threshold=t, attention_weight=w)
    h.add("long", prompt(1, 120), max_tokens=2)
    chunks, starts = [], []
    while not h.sched.requests["long"].output_token_ids:
        item = scheduled_ids(h.step())["long"]
        starts.append(item.num_computed_tokens)
        chunks.append(item.num_new_tokens)

    def cost(n: int, p0: int) -> float:
        return n + w * (n * p0 + n * (n + 1) / 2)

    assert chunks[0] == t and sum(chunks) == 120
    assert all(a >= b for a, b in itertools.pairwise(chunks[:-1]))  # shrinking
    assert chunks[-2] < t / 2  # deep in the prompt a chunk is much shorter...
    for n, p0 in zip(chunks, starts, strict=True):  # ...and each is as long as allowed
        assert cost(n, p0) <= cost(t, 0) < cost(n + 1, p0) or p0 + n == 120
    h.run_all()
    assert h.done["long"].output_token_ids == reference(
        prompt(1, 120), SamplingParams(max_tokens=2), None, 8192
    )


def test_without_chunking_a_prompt_waits_for_budget() -> None:
    h = Harness(100, max_num_batched_tokens=16, enable_chunked_prefill=False)
    assert h.sched.max_model_len == 16  # a recomputed request must fit one step
    with pytest.raises(RequestTooLongError, match="no chunking"):
        h.add("too-long", prompt(0, 16))
    h.add("a", prompt(1, 3), max_tokens=4)
    h.add("b", prompt(2, 3), max_tokens=4)
    h.step()
    h.add("big", prompt(3, 15), max_tokens=2)  # 15 > 16 - 2 decodes: must wait whole
    while "big" not in scheduled_ids(out := h.step()):
        assert {"a", "b"} & set(scheduled_ids(out))
    assert scheduled_ids(out)["big"].num_new_tokens == 15
    h.run_all()


# -- preemption by recompute ----------------------------------------------------------------
def test_preemption_under_tiny_cache_matches_huge_cache() -> None:
    prompts = {f"r{i}": prompt(i, 5 + 7 * i % 23) for i in range(10)}
    outs = {}
    for num_blocks in (16, 10_000):
        h = Harness(num_blocks, max_num_batched_tokens=32)
        for rid, p in prompts.items():
            h.add(rid, p, max_tokens=30, ignore_eos=True)
        h.run_all()
        outs[num_blocks] = {rid: r.output_token_ids for rid, r in h.done.items()}
        if num_blocks == 16:
            assert h.sched.num_preemptions >= 3
            assert sum(r.num_preemptions for r in h.done.values()) == h.sched.num_preemptions
        else:
            assert h.sched.num_preemptions == 0
    assert outs[16] == outs[10_000]
    assert all(len(o) == 30 for o in outs[16].values())


def test_newest_request_preempts_itself_and_resumes_from_its_cached_blocks() -> None:
    h = Harness(4, max_num_batched_tokens=64)
    a = h.add("a", prompt(1, 4), max_tokens=8, ignore_eos=True)
    b = h.add("b", prompt(2, 6), max_tokens=12, ignore_eos=True)
    for _ in range(3):
        assert not h.step().preempted_request_ids
    out = h.step()  # b needs its 3rd block, a took the last free one: b is the newest
    assert out.preempted_request_ids == ["b"] and "b" not in scheduled_ids(out)
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(h.sched.waiting) == [b] and b.num_output_tokens == 3
    h.run_all()
    resumed = [x for o in h.history for x in o.scheduled if x.request is b][3]
    assert resumed.num_computed_tokens == 4  # its first block survived in the free queue
    assert b.num_cached_tokens == 0 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.output_token_ids == reference(prompt(2, 6), b.sampling_params, None, 16)
    assert a.output_token_ids == reference(prompt(1, 4), a.sampling_params, None, 16)
    assert b.finish_reason == "length" and b.num_tokens == 16  # the whole cache


def test_length_capped_by_whole_cache() -> None:
    h = Harness(3, max_num_batched_tokens=64)  # 12 tokens of KV in all
    assert h.sched.max_model_len == 12
    r = h.add("a", prompt(1, 10), max_tokens=100, ignore_eos=True)
    h.run_all()
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 12


# -- prefix caching ---------------------------------------------------------------------------
def test_prefix_hit_from_finished_request() -> None:
    h = Harness(64)
    base = prompt(1, 30)
    a = h.add("a", base, max_tokens=6, ignore_eos=True)
    h.run_all()
    assert a.num_cached_tokens == 0
    cases = {
        "shares-22": (base[:22] + prompt(9, 5), 20),
        "same": (base, 28),  # 30 tokens: whole blocks, at most 29
        "same-32": (a.all_token_ids[:32], 28),  # 32 tokens: at most 31 -> 28
        "with-outputs": (a.all_token_ids[:35], 32),  # a's generated tokens were cached too
        "other": (prompt(5, 30), 0),
    }
    for rid, (p, hit) in cases.items():
        r = h.add(rid, p, max_tokens=2)
        first = scheduled_ids(h.step())[rid]
        assert first.num_computed_tokens == r.num_cached_tokens == hit, rid
        h.run_all()
    salted = Request("salted", base, SamplingParams(max_tokens=2), cache_salt="s")
    h.sched.add_request(salted)
    h.run_all()
    assert salted.num_cached_tokens == 0
    stats = h.sched.stats()
    assert stats["prefix_cache_hits"] == 20 + 28 + 28 + 32
    assert stats["prefix_cache_queries"] == 30 + 27 + 30 + 32 + 35 + 30 + 30


def test_full_cache_skips_lookups_of_a_stuck_request() -> None:
    h = Harness(4)  # 16 tokens of KV
    h.add("a", prompt(1, 12), max_tokens=4, ignore_eos=True)
    h.step()
    h.add("b", prompt(2, 3))
    for _ in range(3):  # a holds all 4 blocks until it finishes (in the 3rd of these)
        assert "b" not in scheduled_ids(h.step())
        assert h.pool.get_num_free_blocks() == (4 if "a" in h.done else 0)
    assert h.kv.prefix_cache_queries == 12  # b was never looked up meanwhile
    assert "b" in scheduled_ids(h.step())
    assert h.kv.prefix_cache_queries == 12 + 3


def test_admission_in_same_step_hits_blocks_being_written() -> None:
    h = Harness(64)
    p = prompt(1, 17)
    h.add("a", p, max_tokens=3)
    h.add("b", p, max_tokens=3)
    out = scheduled_ids(h.step())
    assert out["b"].num_computed_tokens == 16  # registered at allocation, written this step
    h.run_all()
    assert h.done["a"].output_token_ids == h.done["b"].output_token_ids


# -- aborts, rejection, limits -----------------------------------------------------------------
def test_abort_frees_blocks_immediately() -> None:
    h = Harness(20, max_num_batched_tokens=8)
    h.add("run", prompt(1, 12), max_tokens=50)
    h.add("wait", prompt(2, 12), max_tokens=50)
    h.step()  # "run" takes the whole budget; "wait" waits
    assert h.pool.get_num_free_blocks() == 18
    h.sched.abort_requests(["run"])
    assert h.pool.get_num_free_blocks() == 20 and "run" not in h.kv.req_to_blocks
    h.sched.abort_requests("wait")
    h.sched.abort_requests(["run", "never-existed"])  # no-op
    assert not h.sched.has_unfinished_requests()
    out = h.sched.schedule()
    assert out.finished_request_ids == ["run", "wait"] and not out.scheduled
    assert h.sched.schedule().finished_request_ids == []
    h.assert_drained()


def test_abort_between_schedule_and_update() -> None:
    h = Harness(20)
    r = h.add("a", prompt(1, 5))
    out = h.sched.schedule()
    sampled = FakeRunner().execute(out)
    h.sched.abort_requests(["a"])
    assert h.sched.update_from_output(out, sampled) == []
    assert r.status == RequestStatus.FINISHED_ABORTED and r.num_output_tokens == 0
    h.assert_drained()


def test_too_long_prompts_are_rejected_not_hung() -> None:
    h = Harness(1000, max_model_len=20)
    with pytest.raises(RequestTooLongError, match="max_model_len=20"):
        h.add("a", prompt(1, 20))
    h.add("ok", prompt(1, 19))
    h2 = Harness(5)  # 20 tokens of KV, default max_model_len 8192
    with pytest.raises(RequestTooLongError, match="whole KV cache=20"):
        h2.add("a", prompt(1, 20))
    assert not h2.sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="duplicate"):
        h.add("ok", prompt(2, 3))


def test_request_that_cannot_fit_an_empty_cache_fails_not_retried() -> None:
    """It ends with an error the engine turns into the request's output (the engine's
    side: tests/replica/engine/test_fault_isolation.py), not silently and not in a retry loop."""
    h = Harness(5)
    r = h.add("a", prompt(1, 10))
    r.all_token_ids.extend(range(15))  # behind the scheduler's back: 25 tokens > 20 slots
    h.run_all(max_steps=3)
    assert r.status == RequestStatus.FINISHED_ERROR and "kv cache capacity" in (r.error or "")
    assert h.sched.unfit_req_ids == ["a"]


def test_max_num_seqs() -> None:
    h = Harness(500, max_num_seqs=3)
    for i in range(10):
        h.add(f"r{i}", prompt(i, 6), max_tokens=5, ignore_eos=True)
    h.run_all()
    assert max(len(o.scheduled) for o in h.history) == 3  # the harness checks running <= 3
    assert len(h.done) == 10


# -- stopping -----------------------------------------------------------------------------------
def scripted(tokens: list[int]) -> Callable[[SchedulerOutput], dict[str, int]]:
    """Every request generates ``tokens`` in order."""
    return lambda out: {
        x.request.request_id: tokens[x.request.num_output_tokens]
        for x in out.scheduled
        if x.samples
    }


@pytest.mark.parametrize(
    ("sp", "eos", "outputs", "status", "stop_reason"),
    [
        ({"max_tokens": 10}, 7, [5, 6, 7], "stop", None),
        ({"max_tokens": 10, "ignore_eos": True}, 7, list(range(5, 15)), "length", None),
        ({"max_tokens": 4}, None, [5, 6, 7, 8], "length", None),
        ({"max_tokens": 10, "stop_token_ids": [8, 6]}, 7, [5, 6], "stop", 6),
        ({"max_tokens": 10, "min_tokens": 4}, 7, list(range(5, 15)), "length", None),
        ({"max_tokens": 10, "min_tokens": 3, "stop_token_ids": [7]}, None, [5, 6, 7], "stop", 7),
        ({"max_tokens": 3}, 7, [5, 6, 7], "stop", None),  # a stop token wins over length
        ({"max_tokens": 1}, None, [5], "length", None),
    ],
)
def test_stop_conditions(
    sp: dict[str, Any], eos: int | None, outputs: list[int], status: str, stop_reason: int | None
) -> None:
    h = Harness(100, runner=scripted(list(range(5, 25))))
    r = h.add("a", prompt(1, 6), eos=eos, **sp)
    h.run_all()
    assert r.output_token_ids == outputs and r.all_token_ids == prompt(1, 6) + outputs
    assert r.finish_reason == status
    assert r.stop_reason == stop_reason


def test_finish_requests_from_the_engine() -> None:
    h = Harness(100, runner=scripted(list(range(5, 25))))
    r = h.add("a", prompt(1, 6), max_tokens=10)
    h.step()
    updated = h.sched.update_from_output(h.sched.schedule(), {"a": 6})
    assert updated == [r] and r.output_token_ids == [5, 6]
    r.stop_reason = "stop-string"
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert r.finish_reason == "stop" and h.sched.schedule().finished_request_ids == ["a"]
    with pytest.raises(ValueError, match="not a finished status"):
        h.sched.finish_requests(["a"], RequestStatus.RUNNING)
    h.assert_drained()


def test_stats_report_queued_load() -> None:
    h = Harness(100, max_num_batched_tokens=10)
    h.add("a", prompt(1, 25))
    h.add("b", prompt(2, 7))
    assert h.sched.stats()["num_queued_prefill_tokens"] == 32
    h.step()
    s = h.sched.stats()
    assert (s["num_waiting"], s["num_running"], s["num_decoding"]) == (1, 1, 0)
    assert s["num_queued_prefill_tokens"] == 15 + 7 and s["num_free_blocks"] == 97


# -- random workloads ---------------------------------------------------------------------------
arrival = st.tuples(
    st.integers(0, 2),  # which shared base prefix
    st.integers(0, 16),  # how much of it
    st.integers(1, 12),  # own suffix length
    st.integers(1, 24),  # max_tokens
    st.sampled_from([None, 0, 1]),  # eos (VOCAB is small: eos does turn up)
)
step_plan = st.tuples(
    st.lists(arrival, max_size=4),
    st.one_of(st.none(), st.integers(0, 10**6)),  # abort the i-th live request (mod live)
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_arrivals_and_aborts(data: st.DataObject) -> None:
    """All requests finish (or were aborted) with the reference output, whatever the
    tenants; no leaks; events replay to the pool's cached set after every step (checked by
    the harness)."""
    chunked = data.draw(st.booleans(), "chunked")
    h = Harness(
        data.draw(st.integers(3, 16), "num_blocks"),
        max_num_batched_tokens=data.draw(st.integers(1 if chunked else 2, 48), "budget"),
        max_num_seqs=data.draw(st.integers(1, 8), "max_num_seqs"),
        max_model_len=data.draw(st.integers(8, 64), "max_model_len"),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=data.draw(st.sampled_from([0, 0, 3, 8]), "threshold"),
        max_num_partial_prefills=data.draw(st.sampled_from([0, 1, 2]), "partial_prefills"),
    )
    limit = h.sched.max_model_len
    n_tenants = data.draw(st.integers(0, 3), "tenants")  # 0: no tenant, one FCFS group
    bases = [prompt(100 + i, 16) for i in range(3)]
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    plan = data.draw(st.lists(step_plan, min_size=2, max_size=12), "plan")
    for step, (arrivals, abort) in enumerate(plan):
        for j, (base, k, n, max_tokens, eos) in enumerate(arrivals):
            rid = f"s{step}r{j}"
            p = bases[base][:k] + prompt(step * 10 + j, n)
            sp = SamplingParams(max_tokens=max_tokens)
            tenant = f"t{(step * 7 + j) % n_tenants}" if n_tenants else None
            req = Request(rid, p, sp, eos, arrival_time=0.0, tenant=tenant)
            if len(p) + 1 > limit:
                with pytest.raises(RequestTooLongError):
                    h.sched.add_request(req)
                continue
            h.sched.add_request(req)
            expected[rid] = reference(p, sp, eos, limit)
        live = sorted(h.sched.requests)
        if live and abort is not None:
            victim = live[abort % len(live)]
            event(f"abort {h.sched.requests[victim].status.name}")
            h.sched.abort_requests([victim])
            aborted.add(victim)
            assert victim not in h.kv.req_to_blocks
        h.step()
    h.run_all()
    p = h.sched.num_preemptions
    event(f"preemptions: {'0' if p == 0 else '1-3' if p <= 3 else '4+'}")
    event(f"prefix hits: {h.kv.prefix_cache_hits > 0}")
    event(f"partial chunks: {any(not x.samples for o in h.history for x in o.scheduled)}")
    assert set(h.done) | aborted == set(expected)
    for rid, r in h.done.items():
        assert r.output_token_ids == expected[rid], rid
