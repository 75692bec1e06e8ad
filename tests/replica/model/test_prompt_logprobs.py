"""Prompt logprobs (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``): every
prompt token's logprob given the tokens before it, equal to transformers' own forward pass,
however the prompt was chunked, preempted or cached."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvroute.events.replica_api import BoundsError, SamplingParams
from kvroute.replica import LLM, tiny_model_path

TOL = 1e-3  # as the output logprobs' check (test_sampling): GPU kernels round differently


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_path(), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i is the log-distribution of token i + 1."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        row = ref[i]
        assert entry[ids[i + 1]] == pytest.approx(float(row[ids[i + 1]]), abs=TOL)
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {ids[i + 1], *top}
        for t in top:
            assert entry[t] == pytest.approx(float(row[t]), abs=TOL)


def params(k: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k, **kw)


def test_prompt_logprobs_equal_transformers_forward(hf: torch.nn.Module) -> None:
    llm = LLM("tiny", num_blocks=128, dtype="float32")
    prompts = ["The quick brown fox jumps over the lazy dog", "kvroute"]
    outs = llm.generate(prompts, [params(3), params(0)])
    for out, k in zip(outs, (3, 0), strict=True):
        ids = list(out.prompt_token_ids)
        check(out.prompt_logprobs, ids, reference(hf, ids), k)
    # A request that asks for none gets none, beside one that asks.
    plain = llm.generate(prompts[1], SamplingParams(max_tokens=1))[0]
    assert plain.prompt_logprobs is None


def test_chunked_and_preempted_prompts_give_each_entry_once(hf: torch.nn.Module) -> None:
    """Chunks of 8 tokens (each chunk's positions in another step) and a cache so small
    that the requests preempt each other and recompute their prompts."""
    tight = LLM("tiny", num_blocks=6, block_size=8, max_num_batched_tokens=8, dtype="float32")
    prompts = ["0123456789abcdef0123", "a b c d e f g h i j k", "The quick brown fox"]
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    outs = tight.generate(prompts, [long for _ in prompts])
    assert tight.llm_engine.scheduler.num_preemptions > 0  # the scenario really happened
    for out in outs:
        ids = list(out.prompt_token_ids)
        check(out.prompt_logprobs, ids, reference(hf, ids), 2)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(hf: torch.nn.Module) -> None:
    """The prefix cache holds the prompt's blocks, yet its logprobs need logits: the request
    reads no hit (its own blocks still go to the cache), and its entries are whole."""
    llm = LLM("tiny", num_blocks=128, block_size=4, dtype="float32")
    prompt = "shared prefix shared prefix shared prefix and a tail"
    first = llm.generate(prompt, SamplingParams(max_tokens=1))[0]
    again = llm.generate(prompt, SamplingParams(max_tokens=1))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0  # it is cached
    out = llm.generate(prompt, params(1))[0]
    assert out.num_cached_tokens == 0
    ids = list(out.prompt_token_ids)
    check(out.prompt_logprobs, ids, reference(hf, ids), 1)


def test_prompt_logprobs_bounds() -> None:
    with pytest.raises(BoundsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(BoundsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
