"""The built-in ``tiny`` model: a small Llama with fixed-seed random weights, for tests and CI.

Written by hand (no transformers import, no network) so its folder has the same bytes on
every machine and with every installed version; :func:`kvroute.replica.model.models.tiny_model_path`
builds it into the cache on first use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

TINY_DIR_NAME = "tiny-v1"
_TINY_SEED = 0x6B76_7274  # "kvrt"; part of the model's identity, like the version suffix

# Byte-level vocabulary: ids 0..255 are the bytes themselves, then the special tokens.
TINY_BOS_ID = 256
TINY_EOS_ID = 257
TINY_PAD_ID = 258
TINY_IM_START_ID = 259
TINY_IM_END_ID = 260
_TINY_SPECIALS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
_TINY_VOCAB = 256 + len(_TINY_SPECIALS)

# Sized so a 2,048-token prefill costs tens of times a 32-token one on a 2-core CPU (prefix
# caching must have something to save) while building and loading stay well under a second.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": _TINY_VOCAB,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    # Both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters.
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": TINY_BOS_ID,
    "eos_token_id": TINY_EOS_ID,
    "pad_token_id": TINY_PAD_ID,
    "torch_dtype": "float32",
    "dtype": "float32",
    "use_cache": True,
}

# Uniform init with these standard deviations. Chosen by measurement, not taste: with the
# usual 0.02 everywhere greedy output collapses to 2-3 repeated tokens; with large
# embeddings and small layers the next token depends on the current token only, so an
# engine that scrambled its KV cache would still "match" transformers. These scales give
# 27-31 distinct tokens in 32 greedy steps and keep the last logits of a 2,048-token prompt
# sensitive to its first token (sharp attention from larger q/k).
_TINY_INIT_STD: dict[str, float] = {
    "embed_tokens": 1.0,
    "q_proj": 0.2,
    "k_proj": 0.2,
    "v_proj": 0.0625,
    "o_proj": 0.0625,
    "gate_proj": 0.0625,
    "up_proj": 0.0625,
    "down_proj": 0.0625,
    "lm_head": 0.25,
}

# sha256 of tiny's model.safetensors. The weights are derived from integers only (PCG64's
# raw stream, which numpy guarantees stable, then exactly rounded arithmetic), so this is the
# same on every machine; tests check it.
TINY_SAFETENSORS_SHA256 = "fd7e4f52719fbc586998c4984715b590972c1822838cd5ce9787e5410579597f"

_TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON, so the folder's bytes do not depend on dict order or versions."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Uniform(-a, a) with the given std, identical on every platform and numpy version.

    Generator distribution methods may change between numpy versions and transcendental
    functions differ by an ulp between platforms; PCG64's raw 64-bit stream is guaranteed
    stable, and the arithmetic below is exactly rounded IEEE, so the bytes are too.
    """
    n = int(np.prod(shape))
    raw = rng.bit_generator.random_raw(n)
    k = (raw >> np.uint64(40)).astype(np.float64)  # top 24 bits: an integer in [0, 2**24)
    a = std * np.sqrt(3.0)
    x = (k + 0.5) * (2.0 * a / 2.0**24) - a
    return x.astype(np.float32).reshape(shape)


def tensor_shapes(c: dict[str, Any] = TINY_CONFIG) -> list[tuple[str, tuple[int, ...]]]:
    """LlamaForCausalLM's parameter names and shapes for a Llama config, in a fixed order."""
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return shapes


def _tiny_weights() -> dict[str, np.ndarray]:
    """Fixed-seed weights for tiny; norms are ones, everything else uniform (see above)."""
    rng = np.random.default_rng(_TINY_SEED)
    weights: dict[str, np.ndarray] = {}
    for name, shape in tensor_shapes():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
            continue
        std = next(s for key, s in _TINY_INIT_STD.items() if f".{key}." in f".{name}")
        weights[name] = _uniform(rng, shape, std)
    return weights


def _tiny_tokenizer_json(path: Path) -> None:
    """Byte-level BPE with no merges: one token per UTF-8 byte, id = byte value.

    The same tokenizer family as SmolLM2's (GPT-2 byte-level, Rust ``tokenizers``), so the
    engine's detokenization is exercised the same way; and, unlike ByT5's tokenizer, it does
    not append ``</s>`` to every encoded prompt.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_to_char = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins
    table = _gpt2_byte_chars()
    assert set(table) == set(byte_to_char)
    vocab = {ch: b for b, ch in enumerate(table)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_TINY_SPECIALS))
    assert tok.get_vocab_size() == _TINY_VOCAB
    tok.save(str(path))


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable character for each byte value (index = byte)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny(folder: Path) -> None:
    """Write tiny's files by hand (no transformers import): same bytes whatever is installed."""
    from safetensors.numpy import save_file

    save_file(_tiny_weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", TINY_CONFIG)
    write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": TINY_BOS_ID,
            # End of a chat turn or of a document both stop greedy generation.
            "eos_token_id": [TINY_EOS_ID, TINY_IM_END_ID],
            "pad_token_id": TINY_PAD_ID,
            "do_sample": False,
        },
    )
    _tiny_tokenizer_json(folder / "tokenizer.json")
    write_json(
        folder / "tokenizer_config.json",
        {
            # Named so both transformers 4.x and 5.x load the plain tokenizer.json.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "extra_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,  # decoding must give back the exact bytes
            "model_max_length": TINY_CONFIG["max_position_embeddings"],
            "chat_template": _TINY_CHAT_TEMPLATE,
        },
    )
    write_json(
        folder / "special_tokens_map.json",
        {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        },
    )
