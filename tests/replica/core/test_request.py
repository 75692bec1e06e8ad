"""SamplingParams validation and Request bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.events.replica_api import SamplingParams
from kvroute.replica.core.request import Request, RequestStatus


def test_sampling_params_defaults_and_normalisation() -> None:
    sp = SamplingParams()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.stop) == (16, 1.0, 1.0, 0, [])
    assert not sp.is_greedy and SamplingParams(temperature=0).is_greedy
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens=16
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_params_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_request_tokens_and_status() -> None:
    prompt = [1, 2, 3]
    r = Request("r", prompt, SamplingParams(max_tokens=4), eos_token_id=2, cache_salt="s")
    prompt.append(9)  # the request keeps its own copy
    assert r.all_token_ids == r.prompt_token_ids == [1, 2, 3]
    assert (r.num_cached_tokens, r.num_computed_tokens, r.status) == (-1, 0, RequestStatus.WAITING)
    r.append_output_token(7)
    r.append_output_token(8)
    assert r.all_token_ids == [1, 2, 3, 7, 8] and r.output_token_ids == [7, 8]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (5, 3, 2)
    assert not r.is_finished and r.finish_reason is None
    for status, reason in [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
    ]:
        r.status = status
        assert r.is_finished and r.finish_reason == reason
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", [])
