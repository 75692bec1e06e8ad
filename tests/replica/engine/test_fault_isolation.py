"""Per-request fault isolation: a fault that belongs to one request ends that request alone.

Why a real engine and injected faults: the stages that touch one request's data (its seed,
sampling, logprobs, detokenization, stop checks) run inside a step that every request of the
batch shares. Each test runs a batch of bystanders twice -- alone, then beside a request
whose own stage fails -- and asserts the bystanders' outputs are identical, the faulty
request ends with ``finish_reason="error"`` naming the stage, and no block leaks.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvroute.replica import (
    AsyncLLMEngine,
    EngineConfig,
    EngineDeadError,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)
from kvroute.replica.core.request import Request
from kvroute.replica.model.sampler import Sampler

NUM_BLOCKS = 96
BYSTANDERS: list[tuple[str, SamplingParams]] = [
    ("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ("The answer is", SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)),
    ("x = 1; y =", SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True)),
    ("hello world", SamplingParams(temperature=0.7, seed=11, top_k=20, max_tokens=10)),
]
_ids = itertools.count()


@dataclass(frozen=True)
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: Any
    error: str | None


def assert_same(outs: list[Result], baseline: list[Result]) -> None:
    """The bystanders' outputs are what they were without the faulty request: text, tokens
    and finish exactly; logprobs to 1e-4 (a GPU's kernels may sum a batch in another
    order, which moves the 6th digit; on the CPU they are equal)."""
    assert len(outs) == len(baseline)
    for got, want in zip(outs, baseline, strict=True):
        assert (got.text, got.token_ids, got.finish_reason, got.error) == (
            want.text, want.token_ids, want.finish_reason, want.error
        )  # fmt: skip
        if want.logprobs is None or got.logprobs is None:
            assert got.logprobs is want.logprobs
            continue
        assert len(got.logprobs) == len(want.logprobs)
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            assert g.keys() == w.keys() and all(abs(g[t] - w[t]) <= 1e-4 for t in w)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS))


def fresh(params: SamplingParams) -> SamplingParams:
    """A copy per run (a seeded request's generator lives as long as the request); not
    re-validated, so params past the bounds stay past them."""
    return copy.copy(params)


def run(
    engine: LLMEngine,
    faulty: tuple[str, SamplingParams] | None = None,
    inject: Callable[[LLMEngine, str], None] | None = None,
) -> tuple[list[Result], Result | None]:
    """Steps the bystanders (and the faulty request, added first) to their end."""
    bad_id = None
    if faulty is not None:
        bad_id = f"bad-{next(_ids)}"
        engine.add_request(bad_id, faulty[0], fresh(faulty[1]))
        if inject is not None:
            inject(engine, bad_id)
    rids = [f"ok-{next(_ids)}" for _ in BYSTANDERS]
    for rid, (prompt, params) in zip(rids, BYSTANDERS, strict=True):
        engine.add_request(rid, prompt, fresh(params))
    finals: dict[str, RequestOutput] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in finals, "an output after the final one"
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests(), "requests did not finish"
    assert engine.kv_cache_manager.get_num_free_blocks() == NUM_BLOCKS, "blocks leaked"

    def result(rid: str) -> Result:
        c = finals[rid].outputs[0]
        return Result(c.text, list(c.token_ids), c.finish_reason, c.logprobs, c.error)

    return [result(r) for r in rids], (result(bad_id) if bad_id else None)


@pytest.fixture(scope="module")
def baseline(engine: LLMEngine) -> list[Result]:
    outs, _ = run(engine)
    assert all(r.finish_reason in ("length", "stop") and r.error is None for r in outs)
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)


def bypass(params: SamplingParams, **fields: object) -> SamplingParams:
    """Params past the shared bounds, as a caller that skipped them would send."""
    params = fresh(params)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def fail_on_call(obj: Any, attr: str, after: int = 0) -> None:
    """Replaces a per-request object's method with one that raises from call ``after`` on."""
    original, calls = getattr(obj, attr), itertools.count()

    def boom(*args: Any, **kwargs: Any) -> Any:
        if next(calls) >= after:
            raise RuntimeError(f"injected {attr} failure")
        return original(*args, **kwargs)

    setattr(obj, attr, boom)


def state(engine: LLMEngine, rid: str) -> Any:
    return engine._states[rid]


def inject_logprobs(engine: LLMEngine, rid: str) -> None:
    # More alternatives than the vocabulary has: torch's topk raises for this row only.
    state(engine, rid).request.sampling_params.logprobs = 10_000


def inject_detok(engine: LLMEngine, rid: str) -> None:
    fail_on_call(state(engine, rid).detok, "update", after=3)


def inject_stop_string(engine: LLMEngine, rid: str) -> None:
    fail_on_call(state(engine, rid).detok, "_match_stop", after=2)


CASES: dict[str, tuple[SamplingParams, Callable[[LLMEngine, str], None] | None, str]] = {
    # The query of death of issue 9: a seed torch's Generator cannot unpack.
    "seed-2**70": (bypass(SAMPLED, seed=2**70), None, "seed failed: ValueError"),
    "logprobs": (fresh(GREEDY), inject_logprobs, "logprobs failed"),
    "detokenization": (fresh(GREEDY), inject_detok, "detokenization failed: RuntimeError"),
    "stop-string": (
        bypass(GREEDY, stop=["zzzz-never"]),
        inject_stop_string,
        "detokenization failed: RuntimeError",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_faulty_request_fails_alone(engine: LLMEngine, baseline: list[Result], case: str) -> None:
    params, inject, error = CASES[case]
    failures = engine.num_request_failures
    outs, bad = run(engine, ("a faulty request", params), inject)
    assert_same(outs, baseline)
    assert bad is not None and bad.finish_reason == "error", bad
    assert bad.error is not None and error in bad.error
    assert engine.num_request_failures == failures + 1


def test_a_request_the_cache_can_never_hold_fails_alone(
    engine: LLMEngine, baseline: list[Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler ends a waiting request whose blocks an empty cache still refuses (it
    should not happen, given max_model_len); that request gets an error output, not
    silence (its client would wait forever), and the others run as without it."""
    manager = engine.kv_cache_manager
    allocate = manager.allocate_slots

    def refuse_the_bad_one(req: Any, *args: Any, **kwargs: Any) -> Any:
        if req.request_id.startswith("bad-"):
            return None
        return allocate(req, *args, **kwargs)

    monkeypatch.setattr(manager, "allocate_slots", refuse_the_bad_one)
    outs, bad = run(engine, ("never fits", fresh(GREEDY)))
    assert_same(outs, baseline)
    assert bad is not None and bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error is not None and "kv cache capacity" in bad.error


def test_sampling_failure_in_one_row(
    engine: LLMEngine, baseline: list[Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits processing (temperature, top-k, top-p) failing for one row only."""
    faulty = bypass(SAMPLED, top_k=5)
    draw = Sampler._draw

    def draw_or_fail(self: Sampler, row: Any, p: SamplingParams, gen: Any) -> int:
        if p.top_k == 5 and p.max_tokens == SAMPLED.max_tokens:
            raise FloatingPointError("injected logits failure")
        return draw(self, row, p, gen)

    monkeypatch.setattr(Sampler, "_draw", draw_or_fail)
    outs, bad = run(engine, ("logits of death", faulty))
    assert_same(outs, baseline)
    assert bad is not None and bad.finish_reason == "error"
    assert bad.error == "sampling failed: FloatingPointError" and bad.token_ids == []


def test_token_level_stop_check_failure(
    engine: LLMEngine, baseline: list[Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = engine.scheduler
    check = type(sched)._check_stop
    marker = 3  # the faulty request's 4th token fails its stop check

    def check_or_fail(req: Request) -> Any:
        if req.request_id.startswith("bad-") and req.num_output_tokens > marker:
            raise KeyError("injected stop failure")
        return check(sched, req)

    monkeypatch.setattr(sched, "_check_stop", check_or_fail)
    outs, bad = run(engine, ("stop of death", fresh(GREEDY)))
    assert_same(outs, baseline)
    assert bad is not None and bad.finish_reason == "error"
    assert bad.error == "stop check failed: KeyError"
    assert len(bad.token_ids) == marker + 1  # what it generated is still reported


def test_abort_whose_final_text_fails(engine: LLMEngine, baseline: list[Result]) -> None:
    """An abort decodes the request's last text: that failing ends it alone too."""
    rid = f"bad-{next(_ids)}"
    engine.add_request(rid, "aborted", fresh(GREEDY))
    engine.step()
    fail_on_call(state(engine, rid).detok, "flush")
    (out,) = engine.abort_requests([rid])
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert out.outputs[0].error == "detokenization failed: RuntimeError"
    outs, _ = run(engine)  # no state left behind; the engine serves on, unchanged
    assert_same(outs, baseline)


@pytest.mark.parametrize(
    "prompt",
    [[1, 2, 10_000], [-5, 3], [1_000_000_000_000], [1, True], "\ud800 lone surrogate"],
    ids=["past-vocab", "negative", "past-uint32", "bool", "surrogate"],
)
def test_bad_prompts_are_refused_before_they_join_a_batch(
    engine: LLMEngine, baseline: list[Result], prompt: Any
) -> None:
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(f"bad-{next(_ids)}", prompt, fresh(GREEDY))
    assert not engine.has_unfinished_requests()
    outs, _ = run(engine)
    assert_same(outs, baseline)


# -- the async engine: per-request faults keep it alive, shared ones name their batch ------
@pytest.fixture
def async_engine() -> Iterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine.from_config(
        EngineConfig(model="tiny", num_blocks=NUM_BLOCKS, max_num_seqs=1)
    )
    yield eng
    eng.shutdown()


async def collect(engine: AsyncLLMEngine, prompt: str, params: SamplingParams) -> RequestOutput:
    outs = [out async for out in engine.generate(prompt, params)]
    return outs[-1]


async def test_query_of_death_does_not_kill_the_async_engine(
    async_engine: AsyncLLMEngine,
) -> None:
    good = asyncio.create_task(collect(async_engine, "fine", fresh(GREEDY)))
    bad = await asyncio.wait_for(collect(async_engine, "boom", bypass(SAMPLED, seed=2**70)), 30)
    assert bad.outputs[0].finish_reason == "error" and not async_engine.errored
    assert (await asyncio.wait_for(good, 30)).outputs[0].finish_reason == "length"
    again = await asyncio.wait_for(collect(async_engine, "after", fresh(GREEDY)), 30)
    assert len(again.outputs[0].token_ids) == GREEDY.max_tokens


async def test_a_shared_failure_names_the_requests_of_its_step(
    async_engine: AsyncLLMEngine,
) -> None:
    """With one sequence at a time, the running request is in the failing step and the
    queued one is not: only the first may have caused it (a router replays the second)."""
    runner = async_engine.llm_engine.runner
    execute, steps = runner.execute, itertools.count()
    assert not async_engine.wait_failed(0)  # nothing has failed yet

    def execute_then_fail(sched: Any) -> Any:
        if next(steps) == 3:
            raise RuntimeError("injected forward failure")
        return execute(sched)

    runner.execute = execute_then_fail  # type: ignore[method-assign]
    long = bypass(GREEDY, max_tokens=50)
    running = asyncio.create_task(collect(async_engine, "running", long))
    await asyncio.sleep(0)
    queued = asyncio.create_task(collect(async_engine, "queued", long))
    results = await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), 30)
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert [r.suspect for r in results] == [True, False]  # type: ignore[union-attr]
    assert async_engine.errored
    # What a replica waits for before it exits: every request has been handed its error.
    assert async_engine.wait_failed(5)
