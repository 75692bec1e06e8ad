"""Sampling through the real engine: seeds, top-k/top-p limits, logprobs, parameter checks.

Why through ``LLM`` and not the sampler alone: reproducibility of a seeded request is a
property of the whole step loop (per-request generators kept across steps, preemption and
batch mates included), not of one call to ``Sampler.sample``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvroute.events.replica_api import SEED_MAX, SEED_MIN, BoundsError, SamplingParams
from kvroute.replica import LLM, tiny_model_path

PROMPTS = ["The quick brown fox", "kvroute serves", "a b c d e f g", "0123456789abcdef0123"]
N = 8  # tokens per request: enough to tell streams apart, cheap on a CPU


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32 on any device: logprobs are checked against an fp32 reference, and top-k 1
    # against greedy (bf16, the CUDA default, rounds near-ties the other way)
    return LLM("tiny", num_blocks=128, dtype="float32")


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> list[list[int]]:
    """Greedy continuations of PROMPTS, the reference for the limits that reduce to greedy."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    return [tokens(o) for o in outs]


def test_seeded_request_is_the_same_alone_and_beside_others(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=N, ignore_eos=True)
    alone = tokens(llm.generate(PROMPTS[0], seeded)[0])
    assert len(alone) == N
    # Batch mates that draw from the shared generator, from their own seed, or not at all,
    # and prompts of other lengths (so the flattened batch differs in every step).
    mates = [
        SamplingParams(temperature=1.0, max_tokens=N + 3, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=99, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True),
    ]
    outs = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[0]],
        [mates[0], seeded, mates[1], mates[2], seeded],
    )
    assert tokens(outs[1]) == alone
    assert tokens(outs[4]) == alone  # a second request with the same seed: same stream


def test_seeded_request_is_the_same_under_chunking_and_preemption(llm: LLM) -> None:
    """A tight engine preempts and chunks; the seeded request's generator must survive it."""
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=N, ignore_eos=True)
    expected = tokens(llm.generate(PROMPTS[3], seeded)[0])
    tight = LLM("tiny", num_blocks=4, block_size=8, max_num_batched_tokens=8, dtype="float32")
    noise = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True)
    outs = tight.generate([PROMPTS[1], PROMPTS[3], PROMPTS[2]], [noise, seeded, noise])
    assert tight.llm_engine.scheduler.num_preemptions > 0  # the scenario really happened
    assert tokens(outs[1]) == expected


def test_different_seeds_give_different_tokens(llm: LLM) -> None:
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=N, ignore_eos=True) for s in range(4)
    ]
    outs = llm.generate([PROMPTS[0]] * 4, params)
    assert len({tuple(tokens(o)) for o in outs}) == 4


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=5.0, top_k=1, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=5.0, top_p=1e-6, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=5.0, top_k=1, seed=3, max_tokens=N, ignore_eos=True),
        SamplingParams(temperature=5.0, min_p=1.0, max_tokens=N, ignore_eos=True),
    ],
    ids=["top_k=1", "top_p=1e-6", "top_k=1,seeded", "min_p=1"],
)
def test_limits_that_leave_one_token_equal_greedy(
    llm: LLM, greedy: list[list[int]], params: SamplingParams
) -> None:
    # A high temperature makes a plain draw almost never greedy, so a pass means the limit
    # really cut the distribution to its argmax.
    outs = llm.generate(PROMPTS, params)
    assert [tokens(o) for o in outs] == greedy


def test_high_temperature_without_limits_is_not_greedy(llm: LLM, greedy: list[list[int]]) -> None:
    """The control for the test above: the same temperature without a limit differs."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=5.0, max_tokens=N, ignore_eos=True))
    assert [tokens(o) for o in outs] != greedy


def test_unseeded_sampling_varies_across_requests(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True)
    outs = llm.generate([PROMPTS[2]] * 6, params)
    assert len({tuple(tokens(o)) for o in outs}) >= 5


def _reference_logprobs(prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' own logits at each generated position: [N, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_path(), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start : start + len(output_ids)], dim=-1)


def test_logprobs_match_the_model_and_list_the_top_n(llm: LLM) -> None:
    top_n = 3
    out = llm.generate(
        PROMPTS[0],
        # Not 1.0: the logprobs are the raw model's, before temperature, as in vLLM.
        SamplingParams(temperature=0.5, seed=5, max_tokens=N, ignore_eos=True, logprobs=top_n),
    )[0]
    ids = tokens(out)
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == len(ids) == N
    ref = _reference_logprobs(out.prompt_token_ids, ids)
    for i, (tok, entry) in enumerate(zip(ids, lps, strict=True)):
        assert tok in entry and entry[tok] <= 0.0
        # The sampled token's logprob, and the top-N, are those of the model's raw logits.
        assert math.isclose(entry[tok], float(ref[i, tok]), abs_tol=1e-3)
        want_top = ref[i].topk(top_n).indices.tolist()
        assert set(want_top) <= set(entry)
        # Top-N plus the sampled token when it is not among them: never anything else.
        assert len(entry) == (top_n if tok in want_top else top_n + 1)
        for t, lp in entry.items():
            assert math.isclose(lp, float(ref[i, t]), abs_tol=1e-3)


def test_logprobs_zero_gives_the_sampled_token_only_and_none_gives_nothing(llm: LLM) -> None:
    with_zero, without = llm.generate(
        [PROMPTS[1], PROMPTS[1]],
        [
            SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        ],
    )
    lps = with_zero.outputs[0].logprobs
    assert lps is not None and len(lps) == 4
    for tok, entry in zip(tokens(with_zero), lps, strict=True):
        assert list(entry) == [tok] and entry[tok] <= 0.0
    assert without.outputs[0].logprobs is None


def test_more_logprobs_than_the_vocabulary_is_refused_and_the_engine_lives_on(llm: LLM) -> None:
    vocab = llm.llm_engine.runner.model.config.vocab_size
    params = SamplingParams(max_tokens=2)
    params.logprobs = vocab + 1  # past the shared bounds, as a caller that skipped them
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(PROMPTS[0], params)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2, logprobs=2))
    assert len(tokens(out[0])) == 2


def _hf_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_path(), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_repetition_penalty_equals_transformers_generate(llm: LLM) -> None:
    """transformers' ``repetition_penalty`` uses vLLM's rule (over prompt and output)."""
    model, penalty, changed = _hf_model(), 1.8, 0
    for prompt in PROMPTS[:2]:
        out, plain = llm.generate(
            [prompt, prompt],
            [
                SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=penalty),
                SamplingParams(temperature=0.0, max_tokens=12),
            ],
        )
        ids = out.prompt_token_ids
        with torch.inference_mode():
            ref = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=penalty,
            )[0, len(ids) :].tolist()
        assert tokens(out) == ref, prompt
        changed += tokens(out) != tokens(plain)
    assert changed  # the penalty decided something (PROMPTS[1]: from the 7th token)


def _greedy_with_openai_penalties(
    model: torch.nn.Module, prompt: list[int], n: int, presence: float, frequency: float
) -> list[int]:
    """A greedy loop over transformers' logits with OpenAI's penalties written out: each
    output token's logit less ``frequency`` per time it was output and ``presence`` once."""
    out: list[int] = []
    for _ in range(n):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


def test_presence_and_frequency_penalties_equal_their_definition(llm: LLM) -> None:
    model, n = _hf_model(), 24  # long enough for greedy to repeat itself on this model
    kinds = [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"presence_penalty": -1.0, "frequency_penalty": -0.5},
        {},  # a batch mate without penalties is untouched
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw) for kw in kinds]
    outs = llm.generate([PROMPTS[0]] * 4, params)
    plain = tokens(outs[3])
    assert plain == _greedy_with_openai_penalties(model, outs[3].prompt_token_ids, n, 0.0, 0.0)
    for out, p in zip(outs[:3], params[:3], strict=True):
        want = _greedy_with_openai_penalties(
            model, out.prompt_token_ids, n, p.presence_penalty, p.frequency_penalty
        )
        assert tokens(out) == want and want != plain, p
    # The penalties change what is chosen, not what logprobs report (the raw model's).
    pen = llm.generate(
        PROMPTS[0],
        SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, presence_penalty=2.0, logprobs=0
        ),
    )[0]
    ref = _reference_logprobs(pen.prompt_token_ids, tokens(pen))
    for i, (tok, entry) in enumerate(zip(tokens(pen), pen.outputs[0].logprobs, strict=True)):
        assert math.isclose(entry[tok], float(ref[i, tok]), abs_tol=1e-3)


def test_logit_bias_moves_the_logits_it_names(llm: LLM, greedy: list[list[int]]) -> None:
    model = _hf_model()
    forced, banned, mixed = llm.generate(
        [PROMPTS[0]] * 3,
        [
            SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logit_bias=bias)
            for bias in ({65: 100.0}, {t: -100.0 for t in greedy[0]}, {greedy[0][0]: -3, 66: 2})
        ],
    )
    assert tokens(forced) == [65] * N
    assert not set(tokens(banned)) & set(greedy[0])
    # A moderate bias equals greedy over transformers' logits plus the bias.
    ids, out = mixed.prompt_token_ids, []
    for _ in range(N):
        with torch.inference_mode():
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            logits[greedy[0][0]] -= 3
            logits[66] += 2
        out.append(int(logits.argmax()))
    assert tokens(mixed) == out != greedy[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: must be an int >= 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens: must be an int >= 1, got 2.5"),
        ({"max_tokens": True}, "max_tokens: must be an int >= 1, got True"),
        ({"temperature": -0.1}, "temperature: must be a finite number >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature: must be a finite number >= 0, got nan"),
        ({"temperature": "hot"}, "temperature: must be a finite number >= 0, got 'hot'"),
        ({"top_p": 0.0}, "top_p: must be a number in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p: must be a number in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k: must be an int >= 0 (0 or -1: off), got -2"),
        ({"seed": "seven"}, "seed: must be an int in [-9223372036854775808, 9223372036854775807]"),
        ({"seed": 2**70}, "seed: must be an int in [-9223372036854775808, 9223372036854775807]"),
        ({"seed": 2**63}, "seed: must be an int in [-9223372036854775808, 9223372036854775807]"),
        ({"stop": [""]}, "stop: must hold strings of 1 to 512 characters"),
        ({"stop": ["\ud800"]}, "stop: must be valid Unicode (no lone surrogates)"),
        ({"stop_token_ids": [-1]}, "stop_token_ids: must hold ints in [0, 4294967295]"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens: must be an int in [0, max_tokens=4]"),
        ({"logprobs": -1}, "logprobs: must be None or an int in [0, 20]"),
        ({"logprobs": 21}, "logprobs: must be None or an int in [0, 20]"),
        ({"presence_penalty": 2.5}, "presence_penalty: must be a number in [-2.0, 2.0]"),
        ({"frequency_penalty": -3}, "frequency_penalty: must be a number in [-2.0, 2.0]"),
        ({"frequency_penalty": True}, "frequency_penalty: must be a number in [-2.0, 2.0]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty: must be a number in (0, 10.0]"),
        ({"repetition_penalty": 11}, "repetition_penalty: must be a number in (0, 10.0]"),
        ({"min_p": 1.5}, "min_p: must be a number in [0, 1], got 1.5"),
        ({"logit_bias": {5: 101}}, "logit_bias: biases must be numbers in [-100.0, 100.0]"),
        ({"logit_bias": {-1: 1}}, "logit_bias: token ids must be ints in [0, 4294967295]"),
        ({"logit_bias": [1]}, "logit_bias: must map at most 1024 token ids to biases"),
    ],
)
def test_sampling_params_reject_bad_values_naming_field_and_value(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(BoundsError, match=re.escape(message)) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert err.value.param == message.split(":")[0]
    # The wire spec the front door builds checks the very same bounds.
    with pytest.raises(BoundsError, match=re.escape(message)):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_seeds_at_the_bounds_sample() -> None:
    """Every seed the bounds let through is one torch takes (the bounds are not too wide)."""
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        assert SamplingParams(seed=seed).seed == seed
        # torch folds negative seeds into uint64, as the sampler's generator will see them
        assert torch.Generator().manual_seed(seed).initial_seed() == seed % 2**64


def test_sampling_params_normalise_vllm_spellings() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0).is_greedy
