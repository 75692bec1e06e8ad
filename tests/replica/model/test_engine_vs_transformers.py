"""Greedy output of kvroute's engine == transformers ``generate`` on the same weights.

Every mode the engine has that could corrupt the KV cache is exercised: cold cache, prefix
hits, chunked prefill under a small token budget, preemption under a tiny cache, and steps
mixing prefills with decodes.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvroute.replica import LLM, SamplingParams
from kvroute.replica.engine.llm_engine import EngineConfig, LLMEngine
from kvroute.replica.model.models import tiny_model_path

from ..hf_reference import hf_greedy

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def reference():
    """Memoized transformers greedy continuation of a prompt."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_path(), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    vocab = model.config.vocab_size
    memo: dict[tuple[int, ...], list[int]] = {}

    def continuation(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            memo[key] = hf_greedy(model, prompt, NEW_TOKENS)
        return memo[key]

    continuation.vocab = vocab  # type: ignore[attr-defined]
    eos = model.generation_config.eos_token_id
    continuation.eos = set(eos if isinstance(eos, list) else [eos])  # type: ignore[attr-defined]
    return continuation


def random_prompts(vocab: int, n: int, seed: int, lo: int = 1, hi: int = 260) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_matches(reference, prompts: list[list[int]], outputs) -> None:
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        expected = reference(prompt)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        stopped = len(expected) < NEW_TOKENS or expected[-1] in reference.eos
        assert out.outputs[0].finish_reason == ("stop" if stopped else "length")


def test_cold_cache(reference):
    prompts = random_prompts(reference.vocab, 20, seed=1)
    llm = LLM("tiny", dtype="float32", num_blocks=512)
    outs = llm.generate(prompts, GREEDY)
    assert_matches(reference, prompts, outs)
    assert all(o.num_cached_tokens == 0 for o in outs)


def test_prefix_hits_from_earlier_requests(reference):
    rng = random.Random(2)
    bases = random_prompts(reference.vocab, 5, seed=3, lo=100, hi=200)
    llm = LLM("tiny", dtype="float32", num_blocks=512)
    assert_matches(reference, bases, llm.generate(bases, GREEDY))
    # Continuations of the bases: each shares a block-aligned prefix with an earlier request.
    prompts = []
    for _ in range(20):
        base = rng.choice(bases)
        cut = rng.randint(40, len(base))
        prompts.append(base[:cut] + [rng.randrange(3, reference.vocab) for _ in range(30)])
    outs = llm.generate(prompts, GREEDY)
    assert_matches(reference, prompts, outs)
    assert all(o.num_cached_tokens % 16 == 0 for o in outs)
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 18
    # The whole prompt again: at most prompt_len - 1 tokens can be a hit, still exact.
    again = llm.generate(bases, GREEDY)
    assert_matches(reference, bases, again)
    for b, o in zip(bases, again, strict=True):
        assert o.num_cached_tokens == (len(b) - 1) // 16 * 16


def test_chunked_prefill_small_budget(reference):
    prompts = random_prompts(reference.vocab, 20, seed=4, lo=50, hi=300)
    llm = LLM("tiny", dtype="float32", num_blocks=512, max_num_batched_tokens=40)
    assert_matches(reference, prompts, llm.generate(prompts, GREEDY))


def test_preemption_under_tiny_cache(reference):
    prompts = random_prompts(reference.vocab, 20, seed=5, lo=60, hi=180)
    llm = LLM("tiny", dtype="float32", num_blocks=40, max_num_batched_tokens=512)
    outs = llm.generate(prompts, GREEDY)
    assert_matches(reference, prompts, outs)
    assert llm.llm_engine.stats()["num_preemptions"] > 0


def test_mixed_prefill_and_decode_steps(reference):
    prompts = random_prompts(reference.vocab, 20, seed=6, lo=20, hi=200)
    engine = LLMEngine(
        EngineConfig(model="tiny", dtype="float32", num_blocks=512, max_num_batched_tokens=256)
    )
    results: dict[str, list[int]] = {}
    mixed_steps = 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request per step, so prefills land beside running decodes
            i, p = pending.pop(0)
            engine.add_request(str(i), p, GREEDY)
        sched_before = engine.scheduler.num_running
        outs = engine.step()
        if sched_before and pending:
            mixed_steps += 1
        for o in outs:
            if o.finished:
                results[o.request_id] = o.outputs[0].token_ids
    assert mixed_steps >= 10
    for i, p in enumerate(prompts):
        assert results[str(i)] == reference(p)


def test_tenants_in_turn_change_the_order_never_the_output(reference):
    """Tenant a queues eleven prompts, then tenant b one: b is among the first two admitted,
    and every output still equals transformers' (under preemption, with a tiny cache)."""
    prompts = random_prompts(reference.vocab, 12, seed=9, lo=60, hi=180)
    engine = LLMEngine(
        EngineConfig(model="tiny", dtype="float32", num_blocks=16, max_num_batched_tokens=512)
    )
    tenants = ["a"] * 11 + ["b"]
    reqs = [engine.add_request(str(i), p, GREEDY, tenant=tenants[i]) for i, p in enumerate(prompts)]
    assert [r.tenant for r in reqs] == tenants
    admitted: list[str] = []
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o.outputs[0].token_ids
        # ``running`` is in admission order (a step that admits preempts nobody)
        admitted += [r.request_id for r in engine.scheduler.running if r.request_id not in admitted]
    assert admitted.index("11") <= 1, admitted
    assert engine.stats()["num_preemptions"] > 0
    for i, p in enumerate(prompts):
        assert results[str(i)] == reference(p)


def test_cache_salt_isolates(reference):
    prompt = random_prompts(reference.vocab, 1, seed=7, lo=100, hi=100)[0]
    llm = LLM("tiny", dtype="float32", num_blocks=256)
    first = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY)[0]
    other = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, GREEDY)[0]
    plain = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    same = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0
    assert plain.num_cached_tokens == 0
    assert same.num_cached_tokens == 96
    for o in (first, other, plain, same):
        assert o.outputs[0].token_ids == reference(prompt)


def test_siblings_decoding_over_a_shared_prefix(reference, monkeypatch):
    """Requests hitting one cached prefix decode side by side (the cascade-attention path)."""
    from kvroute.kernels import reference as kernels_ref

    monkeypatch.setenv("KVROUTE_KERNELS_BACKEND", "torch")  # the reference's path, on CUDA too
    calls = []
    real = kernels_ref._decode_cascade
    monkeypatch.setattr(
        kernels_ref, "_decode_cascade", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    rng = random.Random(8)
    prefix = random_prompts(reference.vocab, 1, seed=9, lo=320, hi=320)[0]
    prompts = [prefix + [rng.randrange(3, reference.vocab) for _ in range(rng.randint(1, 40))]]
    prompts += [prefix + [rng.randrange(3, reference.vocab) for _ in range(20)] for _ in range(7)]
    # eager: the torch reference's decode cannot be captured in a CUDA graph (host reads)
    llm = LLM("tiny", dtype="float32", num_blocks=512, enforce_eager=True)
    outs = llm.generate(prompts, GREEDY)
    assert_matches(reference, prompts, outs)
    assert calls, "no step took the shared-prefix decode path"
    assert sum(o.num_cached_tokens == 320 for o in outs) == 7
