"""transformers' own greedy ``generate``: the reference every engine test compares against."""

from __future__ import annotations

import torch


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The new tokens of ``model.generate`` (greedy, stops at the model's EOS as it would)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()
