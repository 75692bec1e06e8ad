"""Fairness between tenants in one engine: the waiting queue takes tenants in turn, and while
tenants compete for a step's prompt tokens the least served goes first within a bounded
step. None of it may change what a request computes, only when."""

from __future__ import annotations

import pytest

from kvroute.replica.core.fair_queue import FairQueue, TenantUsage

from ..scheduling import Harness, prompt, reference, scheduled_ids


def admissions(h: Harness) -> list[str]:
    """Request ids in the order they were first scheduled."""
    seen: dict[str, None] = {}
    for out in h.history:
        for x in out.scheduled:
            seen.setdefault(x.request.request_id, None)
    return list(seen)


@pytest.mark.parametrize("tenants", [True, False])
def test_a_tenants_short_request_is_not_queued_behind_another_tenants_flood(
    tenants: bool,
) -> None:
    """Tenant a queues 20 long prompts, then tenant b one short one, under a budget of half
    a prompt a step: b is admitted right after a's first, not after all of a's. Without
    tenants (one group) the queue is the FCFS it replaces: b comes last."""
    h = Harness(10_000, max_num_batched_tokens=8)
    flood = [f"a{i}" for i in range(20)]
    for i, rid in enumerate(flood):
        h.add(rid, prompt(i, 16), tenant="a" if tenants else None, max_tokens=4, ignore_eos=True)
    h.add("b", prompt(99, 2), tenant="b" if tenants else None, max_tokens=2, ignore_eos=True)
    h.run_all()
    order = admissions(h)
    assert order == (["a0", "b", *flood[1:]] if tenants else [*flood, "b"])
    assert h.sched.num_preemptions == 0
    for r in h.done.values():  # fair order changes when, never what, a request computes
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params, None, 8192)


def test_fair_queue_turns_tenants_and_puts_the_preempted_first() -> None:
    q: FairQueue[tuple[str | None, int]] = FairQueue(lambda item: item[0])
    for item in [("a", 0), ("a", 1), ("a", 2), ("b", 0), (None, 0), ("b", 1)]:
        q.append(item)
    assert list(q) == [("a", 0), ("b", 0), (None, 0), ("a", 1), ("b", 1), ("a", 2)]
    assert q.popleft() == ("a", 0) and q.peek() == ("b", 0)  # a went to the back
    q.appendleft(("a", 0))  # preempted: first of its tenant, its tenant first in the ring
    assert q.peek() == ("a", 0) and len(q) == 6
    q.remove(("b", 1))
    q.remove(("b", 0))  # b's last: its turn goes with it
    assert list(q) == [("a", 0), (None, 0), ("a", 1), ("a", 2)]
    expected = list(q)  # iteration is the order of service
    assert [q.popleft() for _ in range(len(q))] == expected and not q
    with pytest.raises(IndexError):
        q.peek()


def test_without_a_threshold_competing_tenants_share_a_step_by_the_smallest_need() -> None:
    """Tenant a prefills a long prompt; tenant b's short request arrives: while both have
    prompt tokens to compute, the step computes at most the smallest need per tenant (2 x
    b's 24), b's first, so b's step is about twice its own length, not b plus a whole
    chunk of a's; alone again, a's chunks go back to full size. Outputs never change."""
    h = Harness(1000, max_num_batched_tokens=256)
    h.add("long", prompt(1, 1000), tenant="a", max_tokens=2, ignore_eos=True)
    assert scheduled_ids(h.step())["long"].num_new_tokens == 256  # alone: the whole budget
    h.add("short", prompt(2, 24), tenant="b", max_tokens=2, ignore_eos=True)
    out = scheduled_ids(h.step())
    assert out["long"].num_new_tokens == 24 and out["short"].num_new_tokens == 24
    assert scheduled_ids(h.step())["long"].num_new_tokens == 256  # b decodes: a alone again
    h.run_all()
    for r in h.done.values():
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params, None, 8192)


@pytest.mark.parametrize("floor", [0, 96])
def test_a_shared_step_computes_at_least_the_floor(floor: int) -> None:
    """Tenant a prefills a long prompt and tenant b's 4-token prompt arrives: by the smallest
    need a step computes 2 x 4 prompt tokens, which costs a step's fixed cost for 8 tokens
    of work. With ``min_prefill_share_tokens`` (the tokens worth one step's fixed cost) the
    step computes that many instead; b goes first either way, and outputs never change."""
    h = Harness(1000, max_num_batched_tokens=256, min_prefill_share_tokens=floor)
    h.add("long", prompt(1, 1000), tenant="a", max_tokens=2, ignore_eos=True)
    h.step()
    h.add("short", prompt(2, 4), tenant="b", max_tokens=2, ignore_eos=True)
    out = scheduled_ids(h.step())
    assert out["short"].num_new_tokens == 4
    assert out["short"].num_new_tokens + out["long"].num_new_tokens == max(8, floor)
    h.run_all()
    for r in h.done.values():
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params, None, 8192)


def test_the_floor_is_one_steps_fixed_cost_in_prompt_tokens() -> None:
    from kvroute.replica.model.cost_model import H100_8B, CostModel, fair_share_floor

    c = CostModel(H100_8B).coefficients()
    floor = fair_share_floor(c)
    fixed = c.step_overhead_s + c.weights_read_s
    assert floor * c.prefill_s_per_token <= fixed < (floor + 1) * c.prefill_s_per_token
    assert 100 < floor < 400  # an 8B model on an H100: a few hundred tokens, not a step's budget
    with pytest.raises(ValueError, match="min_prefill_share_tokens"):
        Harness(10, min_prefill_share_tokens=-1)


def test_tenant_shares_never_starve_and_one_tenant_schedules_as_before() -> None:
    """Many tenants with short prompts keep coming: the long prompt still gains at least
    the smallest need every step, and finishes. With one tenant nothing is capped."""
    h = Harness(2000, max_num_batched_tokens=128)
    h.add("long", prompt(1, 600), tenant="a", max_tokens=1, ignore_eos=True)
    for i in range(40):
        h.add(f"s{i}", prompt(10 + i, 8), tenant=f"t{i % 5}", max_tokens=1, ignore_eos=True)
        h.step()
    h.run_all()
    assert "long" in h.done and len(h.done) == 41
    solo = Harness(2000, max_num_batched_tokens=128)
    solo.add("long", prompt(1, 600), tenant="a", max_tokens=1)
    solo.add("short", prompt(2, 8), tenant="a", max_tokens=1)
    assert scheduled_ids(solo.step())["long"].num_new_tokens == 128  # one tenant: uncapped


def test_tenant_usage_serves_the_least_served_and_banks_no_idle_credit() -> None:
    u = TenantUsage()
    u.arrived("a")
    u.charge("a", 1000)
    u.arrived("b")  # b joins a busy engine: lifted to the least live count, a's
    assert u.count("b") == 1000
    u.charge("b", 50)
    u.left("b")  # b idles while a keeps going: b's count stays; a's grows past it
    u.charge("a", 5000)
    u.arrived("b")
    assert u.count("b") == 6000  # lifted again: the idle time is no credit against a
    u.left("a")
    u.left("b")
    u.arrived("c")  # the engine was idle: everyone starts equal
    assert u.count("a") == u.count("b") == u.count("c") == 0


def test_with_a_threshold_the_least_served_tenant_takes_the_step_first() -> None:
    """With ``long_prefill_token_threshold`` a step computes at most that many prompt
    tokens while tenants compete. Tenant a has been computing a long prompt; b's request
    arrives and, being the least served, takes its whole need first: a gets what is left
    of the threshold, and nothing when b needs it all. Alone again, a is capped per
    request as usual."""
    h = Harness(2000, max_num_batched_tokens=512, long_prefill_token_threshold=64)
    h.add("long", prompt(1, 1000), tenant="a", max_tokens=2, ignore_eos=True)
    assert scheduled_ids(h.step())["long"].num_new_tokens == 64
    h.add("short", prompt(2, 24), tenant="b", max_tokens=2, ignore_eos=True)
    out = scheduled_ids(h.step())
    assert out["short"].num_new_tokens == 24 and out["long"].num_new_tokens == 40
    h.add("mid", prompt(3, 200), tenant="b", max_tokens=2, ignore_eos=True)
    out = scheduled_ids(h.step())  # b (24 + 1 served) is still behind a (104): b first
    assert out["mid"].num_new_tokens == 64 and "long" not in out
    h.run_all()
    for r in h.done.values():
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params, None, 8192)


def test_two_long_prompts_of_different_tenants_alternate_and_both_finish() -> None:
    """Two tenants' long prompts under a threshold: each step goes to the less served, so
    their progress never drifts apart by more than one step's chunk."""
    h = Harness(4000, max_num_batched_tokens=512, long_prefill_token_threshold=32)
    a = h.add("a", prompt(1, 600), tenant="a", max_tokens=1, ignore_eos=True)
    b = h.add("b", prompt(2, 600), tenant="b", max_tokens=1, ignore_eos=True)
    while a.num_computed_tokens < 600 and b.num_computed_tokens < 600:
        out = h.step()
        assert out.num_scheduled_tokens <= 32
        assert abs(a.num_computed_tokens - b.num_computed_tokens) <= 32
    h.run_all()
    assert set(h.done) == {"a", "b"}


def test_partial_prefills_are_limited_per_tenant() -> None:
    """``max_num_partial_prefills`` 1: tenant a's three long prompts are computed one at a
    time (each step at most one chunk of a's), while a's short prompt that completes in
    one step, and tenant b's long prompt, are not held back by it."""
    h = Harness(4000, max_num_batched_tokens=1024, long_prefill_token_threshold=64,
                max_num_partial_prefills=1)  # fmt: skip
    h.add("a0", prompt(0, 300), tenant="a", max_tokens=1, ignore_eos=True)
    h.add("a-short", prompt(9, 20), tenant="a", max_tokens=1, ignore_eos=True)
    for i in (1, 2):
        h.add(f"a{i}", prompt(i, 300), tenant="a", max_tokens=1, ignore_eos=True)
    out = scheduled_ids(h.step())
    assert set(out) == {"a0", "a-short"}  # a1 and a2 wait for a0's prompt
    h.add("b", prompt(7, 300), tenant="b", max_tokens=1, ignore_eos=True)
    out = scheduled_ids(h.step())
    assert "b" in out  # another tenant's long prompt starts at once
    while h.sched.has_unfinished_requests():
        mid = [
            r
            for r in h.sched.running
            if r.tenant == "a" and r.num_tokens - r.num_computed_tokens > 1
        ]
        assert len(mid) <= 1
        h.step()
    assert len(h.done) == 5
    for r in h.done.values():
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params, None, 8192)
