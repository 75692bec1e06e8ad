"""Decode steps replayed from captured graphs give the eager engine's tokens.

On a CPU the buffers, padding, buckets and self-check run with a capture that calls the
forward again over the static buffers instead of replaying a CUDA graph: everything but
CUDA's own capture. Those engines are built eager (``enforce_eager``), so on CUDA too the
stand-in is the only capture and the reference is really eager. On CUDA (``-m gpu``) real
graphs are captured and must equal the eager path token for token in float32.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kvroute.replica import LLM, SamplingParams
from kvroute.replica.model.cuda_graphs import bucket_sizes

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(1, 90))] for _ in range(n)]


def test_buckets_are_vllms() -> None:
    assert bucket_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(1) == [1]


class _Recompute:
    """A stand-in for CUDA capture: 'replay' calls the function again over the buffers."""

    def __init__(self) -> None:
        self.replays: list[int] = []

    def __call__(self, fn, pool):  # type: ignore[no-untyped-def]
        def replay() -> torch.Tensor:
            out = fn()
            self.replays.append(out.shape[0])
            return out

        return replay


def test_replayed_decodes_equal_eager_tokens() -> None:
    prompts = _prompts(11, seed=1)
    eager = LLM("tiny", num_blocks=256, max_num_seqs=16, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    llm = LLM("tiny", num_blocks=256, max_num_seqs=16, enforce_eager=True)
    runner = llm.llm_engine.runner
    capture = _Recompute()
    runner.enable_decode_graphs(16, llm.llm_engine.max_model_len, capture=capture)
    assert runner.decode_graphs is not None
    capture.replays.clear()  # the self-check's
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    # Decode batches of 11 and fewer ran padded to 16, 8, 4, ... buckets.
    assert 16 in capture.replays
    assert set(capture.replays) <= set(bucket_sizes(16))


def test_a_capture_that_computes_wrong_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM("tiny", num_blocks=256, max_num_seqs=8, enforce_eager=True)
    runner = llm.llm_engine.runner
    runner.enable_decode_graphs(8, llm.llm_engine.max_model_len, capture=_Recompute())
    assert runner.decode_graphs is not None  # a working capture first: the broken one drops it

    def broken(fn, pool):  # type: ignore[no-untyped-def]
        return lambda: torch.zeros_like(fn())

    with caplog.at_level(logging.WARNING, logger="kvroute.replica.model.model_runner"):
        runner.enable_decode_graphs(8, llm.llm_engine.max_model_len, capture=broken)
    assert runner.decode_graphs is None
    assert "replay differs from eager" in caplog.text


def test_batches_past_the_largest_bucket_run_eager() -> None:
    llm = LLM("tiny", num_blocks=256, max_num_seqs=8, enforce_eager=True)
    capture = _Recompute()
    llm.llm_engine.runner.enable_decode_graphs(4, llm.llm_engine.max_model_len, capture=capture)
    capture.replays.clear()
    prompts = _prompts(8, seed=2)
    # Requests that end one after another: the decode batch shrinks from 8 to 1.
    params = [
        SamplingParams(temperature=0.0, max_tokens=2 + 2 * i, ignore_eos=True) for i in range(8)
    ]
    eager = LLM("tiny", num_blocks=256, max_num_seqs=8, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert capture.replays and max(capture.replays) == 4  # 8 decodes: eager; fewer: replayed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_in_fp32() -> None:
    prompts = _prompts(20, seed=3)
    graphs = LLM("tiny", num_blocks=512, dtype="float32", max_num_seqs=32)
    assert graphs.llm_engine.runner.decode_graphs is not None
    eager = LLM("tiny", num_blocks=512, dtype="float32", max_num_seqs=32, enforce_eager=True)
    assert eager.llm_engine.runner.decode_graphs is None
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, GREEDY)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    assert got == want
