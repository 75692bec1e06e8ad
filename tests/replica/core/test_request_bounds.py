"""The shared request bounds against a real engine, by hypothesis.

Why: the front door promises that a request it accepts is one no engine stage fails on,
because both check one definition (:func:`kvroute.events.replica_api.check_sampling`). So:
anything the bounds accept must run to a normal finish on a real tiny engine, beside a
bystander whose output it must not change; anything they refuse never becomes a
``SamplingParams`` (the one type the front door builds and the engine runs).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.events.replica_api import (
    MAX_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    BoundsError,
    SamplingParams,
    check_prompt_token_ids,
)
from kvroute.replica import LLMEngine

_ids = itertools.count()
BYSTANDER = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

texts = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6) | st.sampled_from(
    ["", "\ud800", "a\udc00b", "x" * 600]
)
numbers = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3) | st.booleans()
fields = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(-2, 6) | st.booleans() | st.just(2.5),
        "temperature": numbers | st.floats(0, 3),
        "top_p": numbers | st.floats(0, 1),
        "top_k": st.integers(-3, 300) | st.booleans(),
        "seed": st.none()
        | st.integers(SEED_MIN - 2, SEED_MIN + 2)
        | st.integers(SEED_MAX - 2, SEED_MAX + 2)
        | st.integers(-5, 5)
        | st.sampled_from([2**64, 2**70, "7"]),
        "stop": st.lists(texts, max_size=3) | st.lists(st.integers(), max_size=1),
        "stop_token_ids": st.lists(st.integers(-2, 2**33), max_size=3),
        "ignore_eos": st.booleans() | st.just("yes"),
        "min_tokens": st.integers(-1, 7),
        "logprobs": st.none() | st.integers(-1, MAX_LOGPROBS + 2) | st.booleans(),
    },
)


@pytest.fixture(scope="module")
def engine(tiny_engine: LLMEngine) -> LLMEngine:
    return tiny_engine


@pytest.fixture(scope="module")
def bystander_alone(engine: LLMEngine) -> list[int]:
    return run(engine, None)["by"]


def run(engine: LLMEngine, params: SamplingParams | None) -> dict[str, Any]:
    """The bystander (and ``params``' request, if any) to their end; final outputs by role."""
    roles = {f"by-{next(_ids)}": "by"}
    engine.add_request(next(iter(roles)), "bystander", BYSTANDER)
    if params is not None:
        rid = f"fz-{next(_ids)}"
        roles[rid] = "fz"
        engine.add_request(rid, "fuzzed request", params)
    finals: dict[str, Any] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[roles[out.request_id]] = out.outputs[0]
    assert not engine.has_unfinished_requests()
    return {"by": list(finals["by"].token_ids), "fz": finals.get("fz")}


def outcome(make: Any, kw: dict[str, Any]) -> str | None:
    """None when accepted, else the field the refusal names."""
    try:
        make(**kw)
    except BoundsError as exc:
        return exc.param
    return None


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(kw=fields)
def test_what_the_bounds_accept_runs_and_what_they_refuse_is_refused_alike(
    engine: LLMEngine, bystander_alone: list[int], kw: dict[str, Any]
) -> None:
    refused = outcome(SamplingParams, kw)  # the one type the front door builds and sends
    if refused is not None:
        return
    params = SamplingParams(**kw)
    assert math.isfinite(params.temperature) and SEED_MIN <= (params.seed or 0) <= SEED_MAX
    result = run(engine, params)
    assert result["by"] == bystander_alone
    fuzzed = result["fz"]
    assert fuzzed.finish_reason in ("stop", "length"), (kw, fuzzed.error)
    assert len(fuzzed.token_ids) <= params.max_tokens
    if params.logprobs is not None:
        assert fuzzed.logprobs is not None and len(fuzzed.logprobs) == len(fuzzed.token_ids)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(
        st.integers(-(2**40), 2**40) | st.integers(0, 300) | st.booleans() | st.just(1.0),
        max_size=5,
    )
)
def test_prompt_token_ids_in_vocabulary_only(ids: list[Any]) -> None:
    vocab = 261
    ok = bool(ids) and all(type(t) is int and 0 <= t < vocab for t in ids)
    try:
        check_prompt_token_ids(ids, vocab)
    except BoundsError as exc:
        assert not ok and exc.param == "prompt"
    else:
        assert ok
