"""A request added with ``deltas=True`` (the data plane's) streams exactly the GenerateDelta
that its RequestOutput would have given: same tokens, text, counts, reasons, log-probabilities.

Why: the replica builds each step's delta straight from the request rather than through a
RequestOutput (whose cumulative copies cost more than the delta itself); the front door
must not be able to tell. Two engines run the same requests step for step, one with each
kind of output; every kind of ending is covered: length, stop string, stop token, abort,
a request's own failure, a failover's resume, with and without streamed text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvroute.events.replica_api import GenerateDelta, Resume, SamplingParams
from kvroute.replica import EngineConfig, LLMEngine, RequestOutput

PROMPT = "Deltas, not outputs: "


def as_delta(out: RequestOutput) -> GenerateDelta:
    """A RequestOutput as the data plane carried it before the engine built deltas."""
    comp = out.outputs[0]
    n_out = len(comp.token_ids)
    logprobs = None
    if comp.logprobs is not None:
        logprobs = comp.logprobs[n_out - len(out.delta_token_ids) : n_out]
    return GenerateDelta(
        request_id=out.request_id,
        delta_token_ids=out.delta_token_ids,
        delta_text=out.delta_text,
        finished=out.finished,
        finish_reason=comp.finish_reason,
        stop_reason=comp.stop_reason,
        error=comp.error,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=n_out,
        logprobs=logprobs,
    )


def fail_detok_after(calls: int) -> Callable[[LLMEngine, str], None]:
    def inject(engine: LLMEngine, rid: str) -> None:
        detok, seen = engine._states[rid].detok, [0]
        original = detok.update

        def update(*args: Any) -> str:
            seen[0] += 1
            if seen[0] > calls:
                raise RuntimeError("injected detokenization failure")
            return original(*args)

        detok.update = update  # type: ignore[method-assign]

    return inject


def run(model: str, stream_text: bool, deltas: bool, cases: dict[str, Any]) -> dict[str, list]:
    """Every case's outputs, step by step, as deltas (converted when the engine gave
    RequestOutputs); ``abort`` is aborted after its third step."""
    engine = LLMEngine(EngineConfig(model=model, num_blocks=64, stream_text=stream_text))
    seen: dict[str, list] = {rid: [] for rid in cases}
    for rid, (params, resume, inject) in cases.items():
        engine.add_request(rid, PROMPT, params, resume=resume, deltas=deltas)
        if inject is not None:
            inject(engine, rid)
    steps = 0
    while engine.has_unfinished_requests():
        outs = list(engine.step())
        steps += 1
        if steps == 3:
            outs += engine.abort_requests(["abort"])
        for out in outs:
            seen[out.request_id].append(out if deltas else as_delta(out))
    return seen


@pytest.mark.parametrize("stream_text", [True, False], ids=["streamed", "text-at-end"])
@pytest.mark.parametrize("model", ["tiny", "sim:h100-8b"])
def test_deltas_equal_the_outputs_they_replace(model: str, stream_text: bool) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = run(model, True, False, {"probe": (greedy, None, None)})["probe"]
    tokens = [t for d in first for t in d.delta_token_ids]
    text = "".join(d.delta_text for d in first)
    assert len(tokens) == 12 and len(text) >= 6

    def params(**kw: Any) -> SamplingParams:
        return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw})

    cases = {
        "length": (params(), None, None),
        "logprobs": (params(logprobs=2), None, None),
        "stop-string": (params(stop=[text[4:6]]), None, None),
        "stop-token": (params(ignore_eos=False, stop_token_ids=[tokens[5]]), None, None),
        "abort": (params(logprobs=1), None, None),
        "failure": (params(), None, fail_detok_after(4)),
        "resume": (params(), Resume(output_token_ids=tokens[:3], sent_chars=1), None),
        "seeded": (params(temperature=1.0, seed=7), None, None),
    }
    outputs = run(model, stream_text, False, cases)
    deltas = run(model, stream_text, True, cases)
    assert deltas == outputs
    assert all(isinstance(d, GenerateDelta) for steps in deltas.values() for d in steps)
    finish = {rid: steps[-1].finish_reason for rid, steps in deltas.items()}
    assert finish["stop-token"] == "stop" and finish["abort"] == "abort"
    assert finish["failure"] == ("error" if stream_text else "length")
    assert finish["stop-string"] == "stop" and deltas["stop-string"][-1].stop_reason == text[4:6]
