"""Request priority in the scheduler (vLLM's meaning: lower runs first, default 0).

Most tests run the scheduler over the fake model of ``tests/replica/scheduling.py``: a
request's output is a function of its tokens alone only if every block table, prefix hit and
recompute is right (the runner reads every token's KV back), so "identical to running alone"
is checked on every request. The last tests run the built-in ``tiny`` model.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.events.replica_api import SamplingParams
from kvroute.replica.core.priority_queue import PriorityFairQueue
from kvroute.replica.core.request import Request, RequestStatus
from kvroute.replica.core.scheduler import SchedulerOutput
from kvroute.replica.engine.config import EngineConfig
from kvroute.replica.engine.llm_engine import LLMEngine

from ..scheduling import B, Harness, prompt, reference


class PHarness(Harness):
    """The shared harness, with priorities, and with the checks that still hold when
    urgent requests are admitted ahead of running ones or preempt them."""

    def add(  # type: ignore[override]
        self, rid: str, p: list[int], priority: int = 0, tenant: str | None = None, **sp: Any
    ) -> Request:
        sp.setdefault("ignore_eos", True)
        req = Request(rid, p, SamplingParams(**sp), None, arrival_time=0.0, tenant=tenant,
                      priority=priority)  # fmt: skip
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        s, kv = self.sched, self.kv
        before = {rid: r.status for rid, r in s.requests.items()}
        out = s.schedule()
        self.history.append(out)
        assert out.num_scheduled_tokens == sum(x.num_new_tokens for x in out.scheduled)
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len({x.request.request_id for x in out.scheduled}) == len(out.scheduled)
        assert not set(out.preempted_request_ids) & {x.request.request_id for x in out.scheduled}
        for rid in out.preempted_request_ids:
            assert before[rid] == RequestStatus.RUNNING
        assert len(s.running) <= self.config.max_num_seqs
        prios = [r.priority for r in s.running]
        assert prios == sorted(prios)  # most urgent first: preemption takes the last
        for r in s.waiting:
            assert r.num_computed_tokens == 0 and not kv.get_block_ids(r.request_id)
        for r in s.running:
            assert len(kv.get_block_ids(r.request_id)) == -(-r.num_computed_tokens // B)
        for r in s.update_from_output(out, self.run(out)):  # reads every KV back
            if r.is_finished:
                self.done[r.request_id] = r
        self.pool.check_invariants()
        for ev in kv.take_events():
            self.replay.apply(ev)
        assert self.replay.counts() == self.pool.cached_hash_counts()
        return out

    def alone(self, rid: str) -> list[int]:
        """What ``rid`` generates with nobody else in the engine."""
        req = self.done[rid]
        return reference(req.prompt_token_ids, req.sampling_params, None, self.sched.max_model_len)

    def first_step(self, rid: str) -> int:
        """The step that first scheduled ``rid``."""
        for n, out in enumerate(self.history):
            if any(x.request.request_id == rid for x in out.scheduled):
                return n
        raise AssertionError(f"{rid} never scheduled")

    def resumed_at(self, rid: str) -> int:
        """Where ``rid``'s first step after its first preemption started: its prefix hit."""
        after = next(n for n, o in enumerate(self.history) if rid in o.preempted_request_ids)
        for out in self.history[after + 1 :]:
            for x in out.scheduled:
                if x.request.request_id == rid:
                    return x.num_computed_tokens
        raise AssertionError(f"{rid} never resumed")

    def finish_order(self) -> list[str]:
        return list(self.done)


# -- the queue ----------------------------------------------------------------------------
def test_queue_serves_levels_in_order_tenants_in_turn_within_one() -> None:
    reqs = [
        Request(f"{t}{i}-{p}", [1], tenant=t, priority=p)
        for p in (3, -1, 0)
        for t in ("a", "b")
        for i in range(2)
    ]
    q: PriorityFairQueue[Request] = PriorityFairQueue(lambda r: r.tenant)
    for r in reqs:
        q.append(r)
    assert q.top_priority == -1 and q.num_levels == 3 and len(q) == 12
    order = [r.request_id for r in q]
    assert order[:4] == ["a0--1", "b0--1", "a1--1", "b1--1"]
    assert order[4:8] == ["a0-0", "b0-0", "a1-0", "b1-0"]
    popped = [q.popleft().request_id for _ in range(6)]
    assert popped == order[:6]
    back = Request("pre-3", [1], tenant="b", priority=3)
    q.appendleft(back)  # preempted: first of its level (its tenant first), not of all
    assert q.peek().request_id == "a1-0"
    q.remove(reqs[1])  # "a1-3", aborted while waiting
    assert [r.request_id for r in q] == ["a1-0", "b1-0", "pre-3", "a0-3", "b0-3", "b1-3"]
    assert q.top_priority == 0 and q.num_levels == 2 and len(q) == 6


# -- admission order ----------------------------------------------------------------------
def test_urgent_request_behind_a_queue_is_admitted_first() -> None:
    h = PHarness(200, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        h.add(f"low{i}", prompt(i, 9), priority=5, max_tokens=6)
    h.add("urgent", prompt(99, 9), priority=-2, max_tokens=6)
    h.run_all()
    assert h.first_step("urgent") == 0
    assert h.first_step("low1") > 0  # low0 took the other slot, low1 waited
    assert h.finish_order()[0] == "urgent"
    for rid in h.done:
        assert h.done[rid].output_token_ids == h.alone(rid)
    assert h.sched.num_preemptions == 0  # nobody was running when it came


def test_urgent_request_preempts_for_a_batch_slot() -> None:
    h = PHarness(200, max_num_seqs=2, max_num_batched_tokens=64)
    h.add("low0", prompt(1, 10), priority=1, max_tokens=30)
    h.add("low1", prompt(2, 10), priority=1, max_tokens=30)
    for _ in range(3):
        h.step()
    h.add("urgent", prompt(3, 10), priority=0, max_tokens=5)
    out = h.step()
    assert out.preempted_request_ids == ["low1"]  # the least urgent, newest
    assert "urgent" in {x.request.request_id for x in out.scheduled}
    assert "low0" in {x.request.request_id for x in out.scheduled}  # its decode went on
    h.run_all()
    assert h.finish_order()[0] == "urgent"
    for rid in h.done:
        assert h.done[rid].output_token_ids == h.alone(rid)
    # low1 resumed from its own cached blocks: its recompute started at a prefix hit
    assert h.resumed_at("low1") >= 3 * B  # 13 tokens when preempted: 3 full blocks


def test_urgent_request_preempts_for_blocks() -> None:
    # 14 blocks of 4: two requests at 23 tokens hold 12; the urgent one needs 3 now
    h = PHarness(14, max_num_seqs=8, max_num_batched_tokens=64)
    h.add("low0", prompt(1, 20), priority=2, max_tokens=8)
    h.add("low1", prompt(2, 20), priority=2, max_tokens=8)
    for _ in range(4):
        h.step()
    assert h.kv.get_num_free_blocks() == 2
    hits = h.kv.prefix_cache_hits
    h.add("urgent", prompt(3, 12), priority=-1, max_tokens=4)
    out = h.step()
    assert out.preempted_request_ids == ["low1"]
    assert {x.request.request_id for x in out.scheduled} == {"low0", "urgent"}
    h.run_all()
    assert h.finish_order()[0] == "urgent"
    for rid in h.done:
        assert h.done[rid].output_token_ids == h.alone(rid)
    assert h.kv.prefix_cache_hits > hits  # the victim came back through the prefix cache
    assert h.resumed_at("low1") >= 2 * B


def test_never_preempts_for_an_equal_or_less_urgent_request() -> None:
    # a and b fit the batch and the pool; c fits one of them only when they are done
    cases = ((3, 40, 2, 12), (4, 40, 2, 12), (3, 13, 8, 3), (4, 13, 8, 3))
    for newcomer, blocks, seqs, max_tokens in cases:
        h = PHarness(blocks, max_num_seqs=seqs, max_num_batched_tokens=64)
        h.add("a", prompt(1, 20), priority=3, max_tokens=max_tokens)
        h.add("b", prompt(2, 20), priority=3, max_tokens=max_tokens)
        h.step()
        h.add("c", prompt(3, 20), priority=newcomer, max_tokens=4)
        h.run_all()
        assert h.sched.num_preemptions == 0
        assert h.finish_order()[-1] == "c"
        for rid in h.done:
            assert h.done[rid].output_token_ids == h.alone(rid)


def test_less_urgent_decodes_go_on_while_an_urgent_prompt_is_computed() -> None:
    """The urgent prompt is admitted ahead of the running decodes, yet leaves each of them
    its token: no decode waits a step for it."""
    h = PHarness(400, max_num_seqs=8, max_num_batched_tokens=8)
    for i in range(3):
        h.add(f"low{i}", prompt(i, 3), priority=1, max_tokens=40)
    while len(h.sched.running) < 3 or any(r.num_output_tokens == 0 for r in h.sched.running):
        h.step()
    h.add("urgent", prompt(9, 60), priority=0, max_tokens=2)
    while "urgent" not in h.done:
        ids = {x.request.request_id: x.num_new_tokens for x in h.step().scheduled}
        assert all(ids.get(f"low{i}") == 1 for i in range(3) if f"low{i}" not in h.done)
        assert ids.get("urgent", 0) <= 5  # 8 less the 3 decodes
    h.run_all()
    for rid in h.done:
        assert h.done[rid].output_token_ids == h.alone(rid)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_blocks=st.integers(10, 60),
    budget=st.sampled_from([4, 9, 64]),
    seqs=st.integers(1, 4),
)
def test_any_mix_of_priorities_is_exact(
    data: st.DataObject, num_blocks: int, budget: int, seqs: int
) -> None:
    """Random arrivals, priorities and tenants: every output equals the request's output
    alone, and the scheduler's invariants hold every step (PHarness)."""
    h = PHarness(num_blocks, max_num_seqs=seqs, max_num_batched_tokens=budget)
    n = data.draw(st.integers(1, 8), "n")
    arrivals = sorted(data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)))
    step, i = 0, 0
    while i < n or h.sched.has_unfinished_requests():
        while i < n and arrivals[i] <= step:
            h.add(
                f"r{i}",
                prompt(i, data.draw(st.integers(1, 16), "len")),
                priority=data.draw(st.integers(-1, 2), "priority"),
                tenant=data.draw(st.sampled_from([None, "a", "b"]), "tenant"),
                max_tokens=data.draw(st.integers(1, 10), "max_tokens"),
            )
            i += 1
        if h.sched.has_unfinished_requests():
            h.step()
        step += 1
        assert step < 5000
    for rid in h.done:
        assert h.done[rid].output_token_ids == h.alone(rid)


def test_equal_priorities_schedule_as_priority_zero() -> None:
    """Every request at one level, whatever it is: the same steps as the default level."""

    def run(level: int) -> list[list[tuple[str, int, int]]]:
        h = PHarness(14, max_num_seqs=3, max_num_batched_tokens=10)
        for i in range(7):
            h.add(f"r{i}", prompt(i, 5 + 3 * i), priority=level, tenant="ab"[i % 2],
                  max_tokens=4 + i)  # fmt: skip
        h.run_all()
        return [
            [(x.request.request_id, x.num_computed_tokens, x.num_new_tokens) for x in o.scheduled]
            + [(rid, -1, -1) for rid in o.preempted_request_ids]
            for o in h.history
        ]

    assert run(0) == run(7) == run(-3)


# -- the tiny model ------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tiny(**kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", stream_text=False, **kw))


def _run(engine: LLMEngine, until: set[str]) -> list[str]:
    """Steps until ``until`` have finished; returns every request id in finishing order."""
    order: list[str] = []
    while not until <= set(order):
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
    return order


def _alone(prompt_ids: list[int], params: SamplingParams) -> list[int]:
    engine = _tiny(num_blocks=64)
    engine.add_request("x", prompt_ids, params)
    outs: dict[str, list[int]] = {}
    while "x" not in outs:
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
    return outs["x"]


def test_tiny_model_urgent_first_then_preempted_resume_exactly() -> None:
    engine = _tiny(num_blocks=64, max_num_seqs=2)
    outputs: dict[str, list[int]] = {}
    schedules: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        schedules.append(out)
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    prompts = {f"low{i}": [(7 * i + j) % 50 + 1 for j in range(40)] for i in range(3)}
    long = msgspec_replace(GREEDY, max_tokens=24)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, long, priority=4)
    for _ in range(3):
        engine.step()
    urgent = [(3 * j) % 50 + 2 for j in range(30)]
    engine.add_request("urgent", urgent, GREEDY, priority=-1)
    order: list[str] = []
    while len(order) < 4:
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    assert order[0] == "urgent"
    first = {}
    for n, o in enumerate(schedules):
        for x in o.scheduled:
            first.setdefault(x.request.request_id, n)
    assert first["urgent"] < first["low2"]  # admitted ahead of the queue it came behind
    preempted = {rid for o in schedules for rid in o.preempted_request_ids}
    assert preempted == {"low1"}  # the least urgent, newest of the two running
    assert engine.scheduler.num_preemptions == 1
    assert outputs["urgent"] == _alone(urgent, GREEDY)
    for rid, ids in prompts.items():
        assert outputs[rid] == _alone(ids, long), rid
    # low1's recompute started at its own cached blocks (2 of its 40 prompt tokens' blocks)
    low1 = [x for o in schedules for x in o.scheduled if x.request.request_id == "low1"]
    restart = [x for x in low1 if x.num_computed_tokens and x.num_new_tokens > 1]
    assert restart and restart[0].num_computed_tokens >= 32


def msgspec_replace(params: SamplingParams, **kw: Any) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **kw)


def test_llm_generate_takes_one_priority_per_prompt() -> None:
    """The offline API: outputs in the prompts' order, the same tokens as without."""
    import pytest

    from kvroute.replica import LLM

    llm = LLM(model="tiny", num_blocks=64, max_num_seqs=1)
    prompts = [[5, 6, 7, 8, 9], [9, 8, 7], [1, 2, 3, 4]]
    plain = llm.generate(prompts, GREEDY)
    urgent_last = llm.generate(prompts, GREEDY, priority=[3, 2, -1])
    assert [o.outputs[0].token_ids for o in urgent_last] == [o.outputs[0].token_ids for o in plain]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(prompts, GREEDY, priority=[0])
