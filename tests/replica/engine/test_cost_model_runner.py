"""Cost-model replicas (``model="sim:h100-8b"``): the real engine with the forward pass
replaced by the cost model's step time.

What must hold for a fleet of them to stand for a GPU fleet: the scheduler, cache and
events are the engine's own (tests/replica/engine/test_engine_events.py runs its whole event
contract on a cost-model engine too); every step lasts the cost model's time for exactly
the batch the scheduler chose, never less; outputs are deterministic, run to
``max_tokens`` and survive a failover; and a replica is small enough for dozens per machine
(no torch in its process, no CPU reserved in Ray).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import pytest
import ray

from kvroute.events.replica_api import GenerateRequest, Resume, SamplingParams
from kvroute.replica import EngineConfig, LLMEngine
from kvroute.replica.core.scheduler import SchedulerOutput
from kvroute.replica.model.cost_model import H100_8B, CostModel
from kvroute.replica.model.cost_model_runner import output_token, prompt_key
from kvroute.replica.serve.actor import start_replica

from ...dataplane_client import collect
from ...ray_session import local_ray

SIM = "sim:h100-8b"
PROMPT = [(7 * i + 3) % 128_000 for i in range(1000)]


def engine(**kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=SIM, **{"block_size": 16, "time_scale": 0.01, **kw}))


def run(eng: LLMEngine, prompts: dict[str, list[int]], **params: Any) -> dict[str, Any]:
    sp = SamplingParams(**{"max_tokens": 12, **params})
    for rid, p in prompts.items():
        eng.add_request(rid, p, sp)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_cost_model_replica_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from kvroute.replica import EngineConfig, LLMEngine, SamplingParams\n"
        f"e = LLMEngine(EngineConfig(model={SIM!r}, time_scale=0.01))\n"
        "e.add_request('a', list(range(100)), SamplingParams(max_tokens=3))\n"
        "while e.has_unfinished_requests(): e.step()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_outputs_are_deterministic_printable_and_run_to_max_tokens() -> None:
    a = run(engine(), {"x": PROMPT, "y": PROMPT[:500]}, max_tokens=40, temperature=1.0)
    b = run(engine(), {"other-id": PROMPT}, max_tokens=40)
    x = a["x"].outputs[0]
    assert x.finish_reason == "length" and len(x.token_ids) == 40
    assert x.token_ids == [output_token(prompt_key(PROMPT), i) for i in range(40)]
    assert b["other-id"].outputs[0].token_ids == x.token_ids  # fixed by the prompt alone
    assert a["y"].outputs[0].token_ids != x.token_ids
    assert x.text == bytes(x.token_ids).decode() and x.text.isprintable()


def test_prompts_use_the_profiles_vocabulary_and_cache() -> None:
    eng = engine()
    assert eng.vocab_size == H100_8B.vocab_size
    assert eng.runner.num_blocks == H100_8B.kv_tokens // 16
    assert eng.config.max_num_batched_tokens == H100_8B.max_batched_tokens
    with pytest.raises(ValueError, match=r"\[0, 128256\)"):
        eng.add_request("bad", [H100_8B.vocab_size], SamplingParams())
    first = run(eng, {"a": PROMPT})["a"]
    again = run(eng, {"b": [*PROMPT, 5, 6]})["b"]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(PROMPT) // 16 * 16


def test_each_step_lasts_the_cost_models_time_for_its_batch() -> None:
    scale = 0.02
    eng = engine(time_scale=scale)
    cost = CostModel(H100_8B)
    expected: list[float] = []
    execute = eng.runner.execute

    def recording(sched: SchedulerOutput) -> Any:
        tokens = sum(i.num_new_tokens for i in sched.scheduled)
        pairs = sum(
            n * p0 + n * (n - 1) / 2
            for n, p0 in ((i.num_new_tokens, i.num_computed_tokens) for i in sched.scheduled)
        )
        ctx = sum(i.num_computed_tokens + i.num_new_tokens for i in sched.scheduled)
        expected.append(cost.step_time(tokens, pairs, ctx))
        return execute(sched)

    eng.runner.execute = recording  # type: ignore[method-assign]
    long_prompt = [(i * 13) % 128_000 for i in range(20_000)]  # 3 chunks of <= 8192
    start = time.perf_counter()
    run(eng, {"long": long_prompt, "short": PROMPT}, max_tokens=20)
    wall = time.perf_counter() - start
    prefill_chunks = [e for e in expected if e > 0.1]
    assert len(prefill_chunks) == 3  # chunked at the profile's 8,192-token budget
    assert eng.runner.modelled_s == pytest.approx(sum(expected))
    assert wall >= sum(expected) * scale * 0.999  # a step never ends before its time
    assert eng.stats()["modelled_busy_s"] == pytest.approx(sum(expected), abs=1e-5)


def test_coefficients_are_the_profiles_in_wall_clock_seconds() -> None:
    base = CostModel(H100_8B).coefficients()
    c = engine(time_scale=4.0).cost_coefficients()
    assert c.prefill_s_per_token == pytest.approx(4 * base.prefill_s_per_token)
    assert c.weights_read_s == pytest.approx(4 * base.weights_read_s)
    assert c.step_overhead_s == pytest.approx(4 * base.step_overhead_s)
    assert c.kv_capacity_tokens == base.kv_capacity_tokens
    assert c.source == "profile:h100-8b x4"
    with pytest.raises(ValueError, match="time_scale"):
        engine(time_scale=0.0)
    with pytest.raises(ValueError, match="unknown cost-model profile"):
        LLMEngine(EngineConfig(model="sim:nope"))


def test_a_resumed_request_continues_with_the_same_tokens() -> None:
    whole = run(engine(), {"a": PROMPT}, max_tokens=16)["a"].outputs[0].token_ids
    eng = engine()
    eng.add_request(
        "a2", PROMPT, SamplingParams(max_tokens=16), resume=Resume(output_token_ids=whole[:5])
    )
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[-1].outputs[0].token_ids == whole


def test_replica_actors_need_no_cpu_of_their_own() -> None:
    """Six cost-model replica actors on a Ray with two CPUs: ``num_cpus=0`` actors."""
    with local_ray() as started:
        config = {"model": SIM, "block_size": 64, "time_scale": 0.05}
        actors = [start_replica(f"s{i}", config, num_cpus=0) for i in range(6)]
        started.extend(actors)
        infos = ray.get([a.info.remote() for a in actors], timeout=120)
        assert [i.replica_id for i in infos] == [f"s{i}" for i in range(6)]
        assert all(i.cost.source == "profile:h100-8b x0.05" for i in infos)
        assert infos[0].vocab_size == H100_8B.vocab_size

        async def one(actor: Any, rid: str) -> list[int]:
            req = GenerateRequest(
                request_id=rid, prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=8)
            )
            return [t for d in await collect(actor, req) for t in d.delta_token_ids]

        async def all_of() -> list[list[int]]:
            return await asyncio.gather(*(one(a, f"q{i}") for i, a in enumerate(actors)))

        outs = asyncio.run(all_of())
        want = [output_token(prompt_key(PROMPT), i) for i in range(8)]
        assert outs == [want] * 6
        stats = ray.get(actors[0].stats.remote(), timeout=60)
        assert stats["time_scale"] == 0.05 and stats["steps"] >= 8
        assert "torch_threads" not in stats  # no torch in the replica's process
