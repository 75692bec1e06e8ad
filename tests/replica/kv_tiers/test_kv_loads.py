"""When a lower-tier load lands (replica/core/kv_loads.py): a load short beside the step, or
one with nothing else to run, is waited for and its request admitted in the step that
starts it; a long one leaves the step to run and its request waits out of the queue."""

from __future__ import annotations

import pytest

from kvroute.replica import EngineConfig, LLMEngine, SamplingParams
from kvroute.replica.core import kv_loads

from . import test_kv_tiers
from .test_kv_tiers import BLOCK, BLOCK_BYTES, GREEDY, HIT, engine, prompts, run

uncached = test_kv_tiers.uncached  # each prompt's output with room for all (a fixture)


@pytest.fixture(autouse=True)
def patient_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load the rule waits for is waited for up to seconds, not the engine's ~1 ms: these
    tests check which loads are waited for, not how fast a busy machine wakes a thread (a
    clean-clone run beside other work missed the 1 ms and failed two of them)."""
    monkeypatch.setattr(kv_loads, "_WAKE_S", 5.0)
    monkeypatch.setattr(kv_loads, "_MAX_WAIT_S", 5.0)


@pytest.fixture
def warm() -> tuple[LLMEngine, list[list[int]]]:
    """An engine whose host tier holds the first prompt (the device pool evicted it)."""
    eng = engine(kv_host_bytes=64 * BLOCK_BYTES)
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    return eng, ps


def test_with_nothing_else_to_run_a_load_lands_in_its_own_step(
    warm: tuple[LLMEngine, list[list[int]]], uncached: list[list[int]]
) -> None:
    eng, ps = warm
    assert eng.scheduler.kv_loads is not None
    eng.scheduler.kv_loads.step_seconds = 1e-9  # however short steps are: nothing waits
    eng.add_request("again", ps[0], GREEDY)
    eng.step()  # the load, then its request's first chunk, in one step
    assert "again" not in eng.scheduler.loading
    assert [r.request_id for r in eng.scheduler.running] == ["again"]
    assert eng.stats()["kv_tier_loads_inline"] == 1
    final = None
    while eng.has_unfinished_requests():
        final = next((o for o in eng.step() if o.finished), final)
    assert final is not None and final.outputs[0].token_ids == uncached[0]
    assert final.num_tier_cached_tokens == {"CPU": HIT}


@pytest.mark.parametrize("step_seconds, inline", [(100.0, True), (1e-9, False)])
def test_beside_a_running_batch_only_a_short_load_lands_in_its_step(
    warm: tuple[LLMEngine, list[list[int]]],
    uncached: list[list[int]],
    step_seconds: float,
    inline: bool,
) -> None:
    """The same load (its estimate from the bandwidth measured at start), beside steps of
    100 s (a small part of one: waited for) and of 1 ns (off the step)."""
    eng, ps = warm
    eng.add_request("busy", ps[3], GREEDY)
    eng.step()
    loads = eng.scheduler.kv_loads
    assert loads is not None
    loads.step_seconds = step_seconds
    eng.add_request("again", ps[0], GREEDY)
    eng.step()  # "busy" runs; "again" starts its load
    assert ("again" in eng.scheduler.loading) is not inline
    running = {r.request_id for r in eng.scheduler.running}
    assert running == ({"busy", "again"} if inline else {"busy"})
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert outs["again"].outputs[0].token_ids == uncached[0]
    assert outs["busy"].outputs[0].token_ids == uncached[3]
    assert outs["again"].num_tier_cached_tokens == {"CPU": HIT}
    assert eng.stats()["kv_tier_loads_inline"] == int(inline)


def test_kvroute_kv_inline_loads_0_waits_for_no_load(
    monkeypatch: pytest.MonkeyPatch, uncached: list[list[int]]
) -> None:
    """``KVROUTE_KV_INLINE_LOADS=0``, read when the engine is built: even a load with
    nothing else to run lands a step later, and the output is the same."""
    monkeypatch.setenv(kv_loads.INLINE_ENV, "0")
    assert kv_loads.INLINE_ENV == "KVROUTE_KV_INLINE_LOADS"
    eng = engine(kv_host_bytes=64 * BLOCK_BYTES)
    monkeypatch.delenv(kv_loads.INLINE_ENV)  # read once: unsetting it now changes nothing
    loads = eng.scheduler.kv_loads
    assert loads is not None and not loads.inline
    ps = prompts()
    for i, p in enumerate(ps):
        run(eng, f"a{i}", p)
    loads.step_seconds = 1e-9
    eng.add_request("again", ps[0], GREEDY)
    eng.step()
    assert "again" in eng.scheduler.loading  # alone in its step, and still not waited for
    final = None
    while eng.has_unfinished_requests():
        final = next((o for o in eng.step() if o.finished), final)
    assert final is not None and final.outputs[0].token_ids == uncached[0]
    assert final.num_tier_cached_tokens == {"CPU": HIT}
    assert eng.stats()["kv_tier_loads_inline"] == 0


def test_the_engine_times_its_steps_for_the_rule(
    warm: tuple[LLMEngine, list[list[int]]],
) -> None:
    eng, _ = warm
    loads = eng.scheduler.kv_loads
    assert loads is not None and loads.step_seconds > 0.0


def test_a_preempted_request_loads_its_evicted_blocks_again(
    warm: tuple[LLMEngine, list[list[int]]],
) -> None:
    """A request loaded from the host tier, then preempted, whose blocks the device evicts
    (to the host tier) while it waits: it loads them again, as the router prices a
    preemption on a tiered replica, and its output is still the uncached run's."""
    eng, ps = warm
    grow = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    longer = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = LLMEngine(EngineConfig(model="tiny", dtype="float32", block_size=BLOCK, num_blocks=256))
    ref.add_request("ref", ps[0], longer)
    expected = None
    while ref.has_unfinished_requests():
        expected = next((o for o in ref.step() if o.finished), expected)
    assert expected is not None
    # 20 blocks and 16: more than the pool's 24 together
    eng.add_request("grows", ps[3], grow)
    eng.step()
    eng.add_request("again", ps[0], longer)  # admitted last: the preemption's victim
    outs, loads = {}, []
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        loads.append(eng.stats()["kv_tier_loaded"])
    assert outs["again"].outputs[0].token_ids == expected.outputs[0].token_ids
    assert eng.scheduler.num_preemptions >= 1
    assert loads[-1] > HIT // BLOCK  # more than its first load: it loaded again
