"""The Qwen2 family (attention biases, its own rotary config) through the engine.

A small random Qwen2 is written as a normal Hugging Face folder (weights seeded, the built-in
byte tokenizer beside them) and loaded by path, as a user's model would be.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvroute.replica import LLM, SamplingParams
from kvroute.replica.model.models import tiny_model_path

from ..hf_reference import hf_greedy

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=261,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,  # 0.02 makes a random model repeat one token
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(out)
    for f in tiny_model_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def test_qwen2_greedy_equals_transformers_cold_and_cached(qwen2_path: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(qwen2_path, dtype=torch.float32).eval()
    assert hf.model.layers[0].self_attn.q_proj.bias is not None  # the Qwen2 trait under test
    rng = random.Random(3)
    prefix = [rng.randrange(3, 256) for _ in range(96)]
    prompts = [
        prefix + [rng.randrange(3, 256) for _ in range(rng.randint(1, 60))] for _ in range(6)
    ]
    llm = LLM(str(qwen2_path), num_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert all(o.num_cached_tokens == 96 for o in rest)
    for prompt, out in zip(prompts, first + rest, strict=True):
        ref = hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.outputs[0].token_ids == ref
    assert len({tuple(o.outputs[0].token_ids) for o in first + rest}) > 1
