"""AsyncLLMEngine: concurrent streams, cancellation that frees blocks, bad requests, shutdown.

Why real threads and a real model: the failure modes here (a stream that never ends, blocks
that leak after a client goes away, one bad request killing everyone's) only show when the
engine thread, the command queue and the asyncio side all run for real.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from kvroute.replica import (
    LLM,
    AsyncLLMEngine,
    EngineConfig,
    EngineDeadError,
    RequestOutput,
    SamplingParams,
)

NUM_BLOCKS = 48
MAX_MODEL_LEN = 256
PROMPTS = [f"request {i}: " + "abcdefgh"[: i % 8] * (1 + i % 3) for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # outlives any test


@pytest.fixture
def engine() -> Iterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine.from_config(
        EngineConfig(model="tiny", num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    )
    yield eng
    eng.shutdown()


async def wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.01)


def all_blocks_free(engine: AsyncLLMEngine) -> Callable[[], bool]:
    kv = engine.llm_engine.kv_cache_manager
    return lambda: kv.get_num_free_blocks() == NUM_BLOCKS


def assert_ended_early(engine: AsyncLLMEngine) -> None:
    """The LONG request needs >= 150 steps to end by itself: fewer means it was aborted."""
    assert engine.llm_engine.num_steps < 100


async def collect(engine: AsyncLLMEngine, prompt: str | list[int], params=GREEDY, **kw):
    return [out async for out in engine.generate(prompt, params, **kw)]


def assert_stream(outs: list[RequestOutput]) -> RequestOutput:
    """One request's stream: deltas add up, only the last output is finished."""
    assert outs, "no output at all"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    final = outs[-1]
    assert [t for o in outs for t in o.delta_token_ids] == final.outputs[0].token_ids
    assert "".join(o.delta_text for o in outs) == final.outputs[0].text
    return final


async def test_concurrent_streams_finish_and_equal_offline_greedy(engine: AsyncLLMEngine) -> None:
    streams = await asyncio.gather(*(collect(engine, p) for p in PROMPTS))
    finals = [assert_stream(outs) for outs in streams]
    assert len({f.request_id for f in finals}) == len(PROMPTS)
    assert any(len(outs) > 1 for outs in streams)  # tokens really streamed, step by step
    offline = LLM("tiny", num_blocks=NUM_BLOCKS).generate(PROMPTS, GREEDY)
    assert [f.outputs[0].token_ids for f in finals] == [o.outputs[0].token_ids for o in offline]
    assert [f.outputs[0].text for f in finals] == [o.outputs[0].text for o in offline]
    assert all(f.outputs[0].finish_reason == "length" for f in finals)
    await wait_until(all_blocks_free(engine))


async def test_a_slow_consumer_gets_merged_deltas_that_add_up(engine: AsyncLLMEngine) -> None:
    """Outputs that piled up while the consumer slept leave as one (fewer, larger deltas),
    and nothing is lost: the stream still adds up to the offline greedy output."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = []
    async for out in engine.generate(PROMPTS[2], params):
        outs.append(out)
        while engine.llm_engine.num_steps < 12 and not out.finished:  # let steps pile up
            await asyncio.sleep(0.01)
    final = assert_stream(outs)
    assert len(outs) < 40 and max(len(o.delta_token_ids) for o in outs) > 1
    offline = LLM("tiny", num_blocks=NUM_BLOCKS).generate([PROMPTS[2]], params)
    assert final.outputs[0].token_ids == offline[0].outputs[0].token_ids


async def test_load_is_readable_in_the_middle_of_a_step() -> None:
    """A cost-model step of ~1.7 s (an 8,192-token chunk at time_scale 5): the load seen
    meanwhile already counts the request, without waiting for the step to end."""
    eng = AsyncLLMEngine.from_config(EngineConfig(model="sim:h100-8b", time_scale=5.0))
    try:
        assert eng.load.num_waiting == 0 and eng.load.num_running == 0
        stream = eng.generate(list(range(9000)), SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(stream.__anext__())
        await wait_until(lambda: eng.llm_engine.current_batch not in (None, frozenset()))
        assert eng.load.num_waiting + eng.load.num_running == 1
        assert eng.load.queued_prefill_tokens > 0
        assert not first.done()  # the step is still running
        first.cancel()
    finally:
        eng.shutdown()


def test_a_steps_events_leave_right_after_its_outputs() -> None:
    """Every KV-event batch is published after the outputs of the step that made it were
    flushed, and before the next step's: back to back with them."""
    log: list[str] = []

    class Sink:
        deltas = True

        def deliver(self, request_id: str, item: object) -> bool:
            return True

        def flush(self) -> None:
            log.append("outputs")

    eng = AsyncLLMEngine.from_config(
        EngineConfig(model="tiny", num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN),
        [lambda events: log.append("events")],
    )
    try:
        steps = eng.llm_engine.step

        def step() -> list:
            log.append("step")
            return steps()

        eng.llm_engine.step = step  # type: ignore[method-assign]
        eng.submit("r", list(range(3, 3 + 40)), GREEDY, Sink())  # 2 full blocks, then decode
        deadline = time.monotonic() + 30
        while "events" not in log or eng.llm_engine.scheduler.has_unfinished_requests():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        eng.shutdown()
    assert "events" in log
    for i, what in enumerate(log):
        if what == "events":  # the step before it, its outputs, then (other batches and) it
            before = [w for w in log[:i] if w != "events"]
            assert before[-2:] == ["step", "outputs"], log


async def test_breaking_out_of_the_stream_aborts_and_frees_blocks(engine: AsyncLLMEngine) -> None:
    other = asyncio.create_task(collect(engine, PROMPTS[1]))
    seen = 0
    async for out in engine.generate("a long story " * 6, LONG, request_id="quitter"):
        assert not out.finished
        seen += 1
        if seen == 3:
            break
    assert_stream(await other)  # the request beside it is not disturbed
    await wait_until(lambda: not engine.llm_engine.has_unfinished_requests())
    await wait_until(all_blocks_free(engine))
    assert_ended_early(engine)


async def test_the_tenant_reaches_the_scheduler(engine: AsyncLLMEngine) -> None:
    """The scheduler's fair queue groups by the tenant each request carries."""
    stream = engine.generate("tenant's story " * 4, LONG, tenant="alpha")
    first = await anext(stream)
    assert not first.finished
    tenants = await engine.call(lambda e: [r.tenant for r in e.scheduler.requests.values()])
    assert tenants == ["alpha"]
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_until(all_blocks_free(engine))


async def test_the_priority_reaches_the_scheduler(engine: AsyncLLMEngine) -> None:
    """The scheduler's queue orders by the priority each request carries."""
    stream = engine.generate("an urgent story " * 4, LONG, priority=-3, tenant="alpha")
    first = await anext(stream)
    assert not first.finished
    prios = await engine.call(lambda e: [r.priority for r in e.scheduler.requests.values()])
    assert prios == [-3]
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_until(all_blocks_free(engine))


async def test_cancelling_the_consumer_task_aborts_and_frees_blocks(
    engine: AsyncLLMEngine,
) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("cancel me " * 8, LONG):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 20)
    assert engine.llm_engine.kv_cache_manager.get_num_free_blocks() < NUM_BLOCKS
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: not engine.llm_engine.has_unfinished_requests())
    await wait_until(all_blocks_free(engine))
    assert_ended_early(engine)


async def test_explicit_abort_ends_the_stream_with_abort(engine: AsyncLLMEngine) -> None:
    outs: list[RequestOutput] = []
    async for out in engine.generate("abort me", LONG, request_id="victim"):
        outs.append(out)
        if len(outs) == 2:
            engine.abort("victim")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < LONG.max_tokens
    await wait_until(all_blocks_free(engine))


def past_bounds(**fields: object) -> SamplingParams:
    """Params the shared bounds would refuse, as a caller that skipped them would send."""
    params = SamplingParams(max_tokens=2)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", GREEDY, "empty"),
        ([5, 10_000], GREEDY, r"token ids must be ints in \[0, 261\)"),
        ([-1], GREEDY, r"token ids must be ints in \[0, 261\)"),
        ([7] * MAX_MODEL_LEN, GREEDY, "exceed the limit of 256 tokens"),
        ("fine prompt", past_bounds(logprobs=10_000), "logprobs"),
    ],
    ids=["empty", "token-too-big", "token-negative", "too-long", "too-many-logprobs"],
)
async def test_bad_request_fails_alone(
    engine: AsyncLLMEngine, prompt: str | list[int], params: SamplingParams, message: str
) -> None:
    good = [asyncio.create_task(collect(engine, p)) for p in PROMPTS[:3]]
    with pytest.raises(ValueError, match=message):
        await asyncio.wait_for(collect(engine, prompt, params), 20)
    finals = [assert_stream(await asyncio.wait_for(t, 60)) for t in good]
    assert all(len(f.outputs[0].token_ids) == GREEDY.max_tokens for f in finals)
    assert not engine.errored
    assert_stream(await collect(engine, PROMPTS[4]))  # and new work is still accepted


async def test_duplicate_request_id_fails_alone(engine: AsyncLLMEngine) -> None:
    """A second request under a live id is refused; the first one still completes."""
    outs: list[RequestOutput] = []
    first = engine.generate("the first", GREEDY, request_id="same")
    outs.append(await anext(first))  # the first is live in the engine now
    with pytest.raises(ValueError, match="already in use"):
        await asyncio.wait_for(collect(engine, "the second", request_id="same"), 20)

    async def rest() -> None:
        outs.extend([o async for o in first])

    await asyncio.wait_for(rest(), 30)
    assert len(assert_stream(outs).outputs[0].token_ids) == GREEDY.max_tokens


async def test_shutdown_fails_live_streams_and_refuses_new_work() -> None:
    engine = AsyncLLMEngine.from_config(EngineConfig(model="tiny", num_blocks=NUM_BLOCKS))
    stream = engine.generate("still running", LONG)
    first = await asyncio.wait_for(anext(stream), 20)
    assert not first.finished
    await asyncio.to_thread(engine.shutdown)
    assert not engine.thread_alive

    async def drain() -> None:
        async for _ in stream:
            pass

    # A live stream must end (with an error), never hang on a dead engine.
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(drain(), 10)
    with pytest.raises(EngineDeadError, match="shut down"):
        await anext(engine.generate("too late", GREEDY))
    engine.shutdown()  # twice is harmless
