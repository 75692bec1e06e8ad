"""Every causal-LM architecture a user might load: served exactly, or refused at load.

    python benchmarks/probe_architectures.py [NAME ...]

For each architecture below (transformers' own config classes, 2 layers, 64 hidden, random
seeded weights, the built-in byte tokenizer), writes an ordinary Hugging Face folder, loads
it with kvroute's engine and compares greedy tokens with transformers' ``generate``
(``tests/replica/hf_reference.py``): three cold prompts of 5, 40 and 100 tokens in one
batch, then two prompts over a 48-token prefix, twice (the second time cached). A sliding
window of 16 where the architecture has one, shorter than the prompts. One line each:

- ``EQUAL (impl)``: every output equals transformers' (``impl``: kvroute's own decoder or
  transformers' modules on the paged kernels);
- ``REFUSED``: the engine refused it at load, with its reason;
- ``DIFFERENT``: served, with other tokens than transformers' -- the bug this exists to find;
- ``ERROR``: anything else (a crash at load or while serving);
- ``SKIP``: transformers itself could not build or load the config here.

The last line counts each. Run from the repository root (it imports the tests' reference).
CPU, fp32, one thread; ~3 minutes on the 2-vCPU VM. docs/models.md has the latest result.
"""

from __future__ import annotations

import collections
import logging
import random
import shutil
import sys
import tempfile
from pathlib import Path

import kvroute.replica  # noqa: F401 -- first: hides a broken torchvision before transformers

# isort: split
import torch
import transformers
from transformers import AutoModelForCausalLM

from kvroute.replica import LLM, SamplingParams
from kvroute.replica.model.model_runner import UnsupportedModelError
from kvroute.replica.model.models import tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.replica.hf_reference import hf_greedy

S = dict(
    vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    initializer_range=0.2, bos_token_id=256, eos_token_id=257, pad_token_id=258,
    tie_word_embeddings=False,
)  # fmt: skip
W = 16  # sliding window, where the architecture has one
NEW_TOKENS = 8


# architectures whose configs name their fields otherwise (GPT-2's n_embd, ...)
TOKENS = dict(vocab_size=261, bos_token_id=256, eos_token_id=257)
GPT = dict(TOKENS, n_embd=64, n_layer=2, n_head=4, n_positions=1024)
MHA = dict(TOKENS, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def mk(name: str, **extra: object) -> transformers.PretrainedConfig:
    """A Llama-style config class with the shared shape (``S``)."""
    return getattr(transformers, name)(**{**S, **extra})


def other(name: str, base: dict[str, object], **extra: object) -> transformers.PretrainedConfig:
    return getattr(transformers, name)(**{**base, **extra})


ARCHS = {
    "llama": lambda: mk("LlamaConfig"),
    "mistral-window": lambda: mk("MistralConfig", sliding_window=W),
    "mixtral-window": lambda: mk(
        "MixtralConfig", sliding_window=W, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2": lambda: mk("Qwen2Config"),
    "qwen2-moe": lambda: mk(
        "Qwen2MoeConfig",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen3-moe": lambda: mk(
        "Qwen3MoeConfig",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "gemma": lambda: mk("GemmaConfig", head_dim=16),
    "gemma2-softcap": lambda: mk("Gemma2Config", head_dim=16),
    "phi3-window": lambda: mk("Phi3Config", sliding_window=W),
    "phi3": lambda: mk("Phi3Config"),
    "phi": lambda: mk("PhiConfig", partial_rotary_factor=0.5),
    "stablelm": lambda: mk("StableLmConfig", partial_rotary_factor=0.25),
    "olmo": lambda: mk("OlmoConfig"),
    "olmo2": lambda: mk("Olmo2Config"),
    "olmo3-window": lambda: mk("Olmo3Config", sliding_window=W),
    "cohere": lambda: mk("CohereConfig", logit_scale=1.0),
    "cohere-logit-scale": lambda: mk("CohereConfig", logit_scale=0.5),
    "granite": lambda: mk(
        "GraniteConfig",
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=2.0,
    ),
    "starcoder2-window": lambda: mk("Starcoder2Config", sliding_window=W),
    "gpt2": lambda: other("GPT2Config", GPT),
    "gptj": lambda: other("GPTJConfig", GPT, rotary_dim=8),
    "opt": lambda: other(
        "OPTConfig", MHA, ffn_dim=128, max_position_embeddings=1024, word_embed_proj_dim=64
    ),
    "bloom-alibi": lambda: other("BloomConfig", TOKENS, hidden_size=64, n_layer=2, n_head=4),
    "falcon": lambda: other("FalconConfig", MHA, new_decoder_architecture=True, num_kv_heads=2),
    "falcon-alibi": lambda: other("FalconConfig", MHA, alibi=True),
    "mpt-alibi": lambda: transformers.MptConfig(
        vocab_size=261, d_model=64, n_layers=2, n_heads=4, max_seq_len=1024
    ),
    "gpt_oss-sinks": lambda: mk(
        "GptOssConfig",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=W,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "smollm3": lambda: mk("SmolLM3Config"),
    "glm": lambda: mk("GlmConfig", head_dim=16),
    "glm4": lambda: mk("Glm4Config", head_dim=16),
    "exaone4-window": lambda: mk(
        "Exaone4Config", sliding_window=W, layer_types=["sliding_attention", "full_attention"]
    ),
    "helium": lambda: mk("HeliumConfig", head_dim=16),
    "seed_oss": lambda: mk("SeedOssConfig", head_dim=16),
    "apertus": lambda: mk("ApertusConfig"),
    "arcee": lambda: mk("ArceeConfig"),
    "cohere2-window": lambda: mk(
        "Cohere2Config",
        sliding_window=W,
        layer_types=["sliding_attention", "full_attention"],
        logit_scale=1.0,
    ),
    "deepseek_v3": lambda: mk(
        "DeepseekV3Config",
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    "granitemoe": lambda: mk("GraniteMoeConfig", num_local_experts=4, num_experts_per_tok=2),
    "ernie4_5": lambda: mk("Ernie4_5Config", head_dim=16),
    "hunyuan_v1_dense": lambda: mk("HunYuanDenseV1Config", head_dim=16),
    "bitnet": lambda: mk("BitNetConfig"),
    "nemotron": lambda: mk("NemotronConfig", partial_rotary_factor=0.5),
    "persimmon": lambda: other("PersimmonConfig", MHA, intermediate_size=128),
    "llama-rope-dynamic": lambda: mk(
        "LlamaConfig",
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "llama-rope-yarn": lambda: mk(
        "LlamaConfig",
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 8.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama-rope-llama3": lambda: mk(
        "LlamaConfig",
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "rope_theta": 500000.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2-rope-dynamic": lambda: mk(
        "Qwen2Config",
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "phi3-longrope": lambda: mk(
        "Phi3Config",
        max_position_embeddings=256,
        original_max_position_embeddings=32,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
        },
    ),
    "llama-longrope": lambda: mk(
        "LlamaConfig",
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 32,
        },
    ),
    "gpt_neox-mha": lambda: other(
        "GPTNeoXConfig", MHA, intermediate_size=128, rotary_pct=0.25, max_position_embeddings=1024
    ),
    "jamba-hybrid": lambda: mk(
        "JambaConfig",
        num_experts=2,
        num_experts_per_tok=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
    ),
}


def write(name: str, out: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(ARCHS[name]()).save_pretrained(out)
    for f in tiny_model_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def probe(name: str, folder: Path, batches: list[list[list[int]]]) -> str:
    try:
        path = write(name, folder / name)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except Exception as e:  # transformers' own limits, reported
        return f"SKIP transformers: {type(e).__name__}: {str(e)[:100]}"
    try:
        llm = LLM(str(path), num_blocks=64, block_size=16, dtype="float32")
    except UnsupportedModelError as e:
        return f"REFUSED {str(e)[:160]}"
    except Exception as e:
        return f"ERROR at load: {type(e).__name__}: {str(e)[:160]}"
    impl = llm.llm_engine.runner.model_impl
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    try:
        bad = []
        for batch in batches:
            for p, o in zip(batch, llm.generate(batch, greedy), strict=True):
                if o.outputs[0].token_ids != hf_greedy(hf, p, NEW_TOKENS):
                    bad.append(len(p))
    except Exception as e:
        return f"ERROR serving ({impl}): {type(e).__name__}: {str(e)[:160]}"
    return f"DIFFERENT ({impl}): prompts of {bad} tokens" if bad else f"EQUAL ({impl})"


def main() -> int:
    logging.disable(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    names = sys.argv[1:] or list(ARCHS)
    unknown = [n for n in names if n not in ARCHS]
    if unknown:
        print(f"unknown: {unknown}; known: {', '.join(ARCHS)}", file=sys.stderr)
        return 2
    rng = random.Random(0)
    cold = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 40, 100)]
    prefix = [rng.randrange(3, 256) for _ in range(48)]
    shared = [prefix + [rng.randrange(3, 256) for _ in range(k)] for k in (7, 30)]
    counts: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            line = probe(name, Path(tmp), [cold, shared, shared])
            counts[line.split()[0]] += 1
            print(f"{name:22s} {line}", flush=True)
    print("total:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if counts["DIFFERENT"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
