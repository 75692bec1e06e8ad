"""Every supported architecture served exactly, and the others refused, never served wrong.

Small random models of each family are written as ordinary Hugging Face folders (seeded
weights, the built-in byte tokenizer) and loaded by path, as a user's model would be. Each
is run cold, over a cached prefix, in chunks under a small token budget and under
preemption, and must give transformers' own greedy tokens. Sliding windows (16) are
shorter than the prompts, so a window that was ignored changes the tokens.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig

from kvroute.events import BlockHasher, regime_salt
from kvroute.kernels import cpu_linear
from kvroute.replica import LLM, SamplingParams
from kvroute.replica.engine.async_engine import AsyncLLMEngine
from kvroute.replica.engine.config import EngineConfig
from kvroute.replica.model.model_runner import UnsupportedModelError
from kvroute.replica.model.models import tiny_model_path

from ...lora_adapters import SHAPES, make_adapter, peft_reference
from ..hf_reference import hf_greedy

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
WINDOW = 16
SHAPE = {
    "vocab_size": 261,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,  # 0.02 makes a random model repeat one token
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "tie_word_embeddings": False,
}


def _longrope(switch: int) -> dict[str, object]:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
        "original_max_position_embeddings": switch,
    }
    return {**SHAPE, "rope_parameters": rope, "original_max_position_embeddings": switch}


_LONGROPE = _longrope(20)

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-biases": lambda: transformers.LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True),
    "mistral-window": lambda: transformers.MistralConfig(**SHAPE, sliding_window=WINDOW),
    "qwen2-window-layer1": lambda: transformers.Qwen2Config(
        **SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=32),
    "qwen3-window": lambda: transformers.Qwen3Config(
        **SHAPE, head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0
    ),
    "gemma3-window": lambda: transformers.Gemma3TextConfig(
        **SHAPE,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        # Gemma-3-4B's kind: the global layers' rotary scaled, the local ones' not
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        query_pre_attn_scalar=24,
    ),
    # longrope: short factors up to 20 tokens, long ones past it, so the cold batch mixes
    # both regimes and the 17-token prompt crosses during its decode (on Phi-3 up to 30,
    # no crossing: test_phi3_recomputes_at_its_rotary_switch has it)
    "phi3-longrope": lambda: transformers.Phi3Config(**_longrope(30)),
    "phi3-longrope-20": lambda: transformers.Phi3Config(**_longrope(20)),
    "llama-longrope": lambda: transformers.LlamaConfig(**_LONGROPE),
    "gemma2-no-softcap": lambda: transformers.Gemma2Config(
        **SHAPE, head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=None
    ),
}


def write_model(config: PretrainedConfig, out: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in tiny_model_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_model(CONFIGS[name](), tmp_path_factory.mktemp(name))
        return made[name]

    return get


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Cold prompts of 1..100 tokens, and prompts over one 48-token prefix."""
    rng = random.Random(seed)
    cold = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 5, 17, 40, 80, 100)]
    prefix = [rng.randrange(3, 256) for _ in range(48)]
    shared = [prefix + [rng.randrange(3, 256) for _ in range(rng.randint(1, 50))] for _ in range(5)]
    return cold, shared


def _check(hf: torch.nn.Module, prompts: list[list[int]], outs) -> None:  # type: ignore[no-untyped-def]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), len(prompt)


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    """The engine as a CPU replica runs it: one torch thread, so its projections go
    through the tiled C linear kernel (replica/model/linear.py) instead of oneDNN."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("name", "impl", "threads"),
    [
        ("llama-biases", "kvroute", None),
        ("llama-biases", "kvroute", 1),
        ("mistral-window", "kvroute", None),
        ("mistral-window", "transformers", None),
        ("qwen2-window-layer1", "kvroute", None),
        ("qwen2-window-layer1", "kvroute", 1),
        ("qwen3", "kvroute", None),
        ("qwen3-window", "kvroute", None),
        ("gemma3-window", "kvroute", None),
        ("gemma3-window", "kvroute", 1),
        ("gemma3-window", "transformers", None),
        ("phi3-longrope", "transformers", None),
        ("llama-longrope", "kvroute", None),
        ("llama-longrope", "kvroute", 1),
    ],
)
def test_greedy_equals_transformers(model_dir, request, name: str, impl: str, threads) -> None:  # type: ignore[no-untyped-def]
    if threads == 1:
        request.getfixturevalue("one_thread")
    path = model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    hf.eval()
    cold, shared = _prompts(seed=len(name))
    llm = LLM(str(path), num_blocks=256, model_impl=impl, dtype="float32")
    assert llm.llm_engine.runner.model_impl == impl
    if threads == 1 and cpu_linear.isa() is not None:
        assert llm.llm_engine.runner.paged_decoder.layers[0].qkv.form == "tiled"
    _check(hf, cold, llm.generate(cold, GREEDY))
    llm.generate(shared[:1], GREEDY)
    outs = llm.generate(shared[1:], GREEDY)
    assert all(o.num_cached_tokens == 48 for o in outs)
    _check(hf, shared[1:], outs)
    chunked = LLM(
        str(path), num_blocks=256, max_num_batched_tokens=24, model_impl=impl, dtype="float32"
    )
    _check(hf, cold + shared, chunked.generate(cold + shared, GREEDY))
    tight = LLM(
        str(path), num_blocks=16, max_num_batched_tokens=512, model_impl=impl, dtype="float32"
    )
    _check(hf, cold + shared, tight.generate(cold + shared, GREEDY))
    assert tight.llm_engine.stats()["num_preemptions"] > 0


def _greedy_full_forward(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens with every step a forward of the whole sequence (no cache)."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def test_phi3_recomputes_at_its_rotary_switch(model_dir) -> None:  # type: ignore[no-untyped-def]
    """transformers' Phi-3 recomputes a sequence with the long factors where it crosses
    the switch (prepare_inputs_for_generation); the engine does too, so a sequence that
    crosses during its decode (17 + 8 tokens over a switch at 20) gives the greedy tokens
    of a forward of the whole sequence at every step, cold, chunked and preempted. (The
    reference is not generate: transformers 5.19 drops the cache there but then feeds the
    crossing token alone, without its context.)"""
    path = model_dir("phi3-longrope-20")
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    hf.eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (17, 5, 40, 13)]
    want = [_greedy_full_forward(hf, p, NEW_TOKENS) for p in prompts]
    for kwargs in ({}, {"max_num_batched_tokens": 24}, {"num_blocks": 4}):
        llm = LLM(str(path), dtype="float32", **{"num_blocks": 256, **kwargs})
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want, kwargs
        if "num_blocks" in kwargs:
            assert llm.llm_engine.stats()["num_preemptions"] > 0
    # without the recompute the crossing sequence's tokens change
    llm = LLM(str(path), num_blocks=256, dtype="float32")
    llm.llm_engine.runner.rope_spans.whole_sequence = False
    llm.llm_engine.switch_recompute_at = None
    outs = llm.generate(prompts[:1], GREEDY)
    assert outs[0].outputs[0].token_ids != want[0]


@pytest.mark.parametrize(
    ("name", "impl"), [("phi3-longrope", "transformers"), ("llama-longrope", "kvroute")]
)
def test_longrope_regimes_share_no_blocks(model_dir, name: str, impl: str) -> None:  # type: ignore[no-untyped-def]
    """A prompt within the pre-training length and one past it never share cached blocks
    (their keys were computed with other frequencies), in either order; each equals
    transformers alone. Without the per-sequence rotary the mixed batch differs."""
    path = model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    hf.eval()
    rng = random.Random(7)
    long_prompt = [rng.randrange(3, 256) for _ in range(90)]
    short_prompt = long_prompt[:12]
    llm = LLM(str(path), num_blocks=256, model_impl=impl, dtype="float32")
    for first, second in ((short_prompt, long_prompt), (long_prompt, short_prompt)):
        llm.llm_engine.reset_prefix_cache()
        _check(hf, [first], llm.generate([first], GREEDY))
        out = llm.generate([second], GREEDY)
        assert out[0].num_cached_tokens == 0
        _check(hf, [second], out)
    # a router hashes the long prompt as the engine cached it, once told the switch,
    # which the replica reports (EngineFacts -> ReplicaInfo.long_prompt_after)
    engine = llm.llm_engine
    switch = engine.runner.rope_spans.switch
    assert engine.long_prompt_after == switch and switch in (20, 30)
    served = AsyncLLMEngine.from_config(EngineConfig(model=str(path), num_blocks=16))
    try:
        assert served.describe().long_prompt_after == switch
    finally:
        served.shutdown()
    hasher = BlockHasher(block_size=engine.hash_config.block_size)
    salted = regime_salt(None, len(long_prompt), engine.long_prompt_after)
    pool = engine.kv_cache_manager.block_pool
    assert all(
        pool.get_cached_block(h) is not None
        for h in hasher.hash_blocks(long_prompt, cache_salt=salted)
    )
    assert pool.get_cached_block(hasher.hash_blocks(long_prompt)[0]) is None
    mixed = [short_prompt, long_prompt[:40], [5, 6, 7]]
    _check(hf, mixed, llm.generate(mixed, GREEDY))
    rotary = llm.llm_engine.runner.rope_spans
    llm.llm_engine.runner.decoder.rotary_emb = rotary.rotary  # the bug: one call for all
    llm.llm_engine.runner.rope_spans = None
    if impl == "kvroute":
        llm.llm_engine.runner.paged_decoder.rotary = rotary.rotary
    llm.llm_engine.reset_prefix_cache()
    outs = llm.generate(mixed, GREEDY)
    assert any(
        o.outputs[0].token_ids != hf_greedy(hf, p, NEW_TOKENS)
        for p, o in zip(mixed, outs, strict=True)
    )


@pytest.mark.parametrize("name", ["gemma3-window", "qwen3-window", "mistral-window"])
def test_lora_adapters_equal_peft(model_dir, tmp_path: Path, name: str) -> None:  # type: ignore[no-untyped-def]
    """LoRA on the other families' decoders: two random PEFT adapters (every projection;
    the MLP with rsLoRA) and the base in one batch give PEFT's greedy tokens, in fp32."""
    pytest.importorskip("peft")
    path = model_dir(name)
    adapters = {
        f"a{i}": make_adapter(tmp_path / f"a{i}", 40 + i, base_model=path, **SHAPES[1 + i])
        for i in range(2)
    }
    reference = peft_reference(adapters, NEW_TOKENS, base_model=path)
    llm = LLM(str(path), dtype="float32", num_blocks=256, lora_modules=adapters, max_loras=2)
    cold, shared = _prompts(seed=11)
    jobs = [(("a0", "a1", None)[i % 3], p) for i, p in enumerate(cold + shared)]
    outs = llm.generate([{"prompt_token_ids": p, "lora_name": a} for a, p in jobs], GREEDY)
    changed = 0
    for (adapter, prompt), out in zip(jobs, outs, strict=True):
        want = reference(adapter, prompt)
        assert out.outputs[0].token_ids == want, (adapter, len(prompt))
        changed += adapter is not None and want != reference(None, prompt)
    assert changed >= 2  # the adapters change tokens: the equality can fail


def test_window_changes_the_output(model_dir) -> None:  # type: ignore[no-untyped-def]
    """The same weights without the window give other tokens: the test above can fail."""
    path = model_dir("mistral-window")
    windowed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = transformers.AutoConfig.from_pretrained(path)
    config.sliding_window = None
    full = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    cold, shared = _prompts(seed=3)
    long = [p for p in cold + shared if len(p) > 2 * WINDOW]
    assert any(hf_greedy(windowed, p, NEW_TOKENS) != hf_greedy(full, p, NEW_TOKENS) for p in long)


def test_kvroute_impl_refuses_other_families(model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedModelError, match="model_type 'gemma2'"):
        LLM(str(model_dir("gemma2-no-softcap")), num_blocks=16, model_impl="kvroute")


def test_gemma3_switches_each_change_the_tokens(model_dir) -> None:  # type: ignore[no-untyped-def]
    """Gemma3's switches are each needed, so the equality above can fail: a norm weight
    read as Llama's (no +1), the head-dim attention scale, one rotary table for both layer
    types, or a SiLU gate each give other tokens."""
    from kvroute.replica.model.decoder import PagedDecoder

    path = model_dir("gemma3-window")
    # eager: a CUDA graph would keep the switches as they were at capture
    llm = LLM(str(path), num_blocks=64, model_impl="kvroute", dtype="float32", enforce_eager=True)
    decoder: PagedDecoder = llm.llm_engine.runner.paged_decoder
    cold, shared = _prompts(seed=5)
    prompts = cold + shared

    def tokens() -> list[list[int]]:
        llm.llm_engine.reset_prefix_cache()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]

    want = tokens()
    layer = decoder.layers[1]
    layer.attn_out_norm -= 1.0  # type: ignore[operator]
    moved = tokens()
    layer.attn_out_norm += 1.0  # type: ignore[operator]
    scale, decoder.scale = decoder.scale, 16**-0.5
    rescaled = tokens()
    decoder.scale = scale
    ropes = [layer.rope for layer in decoder.layers]
    for layer in decoder.layers:
        layer.rope = "full_attention"
    one_rope = tokens()
    for layer, rope in zip(decoder.layers, ropes, strict=True):
        layer.rope = rope
    decoder.gelu = False
    silu = tokens()
    assert all(got != want for got in (moved, rescaled, one_rope, silu))


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (
            lambda: transformers.Gemma2Config(**SHAPE, head_dim=16, final_logit_softcapping=None),
            "softcap",
        ),
        (lambda: transformers.Gemma2Config(**SHAPE, head_dim=16), "final_logit_softcapping"),
        (  # multi-head latent attention: K/V not num_key_value_heads x head_dim
            lambda: transformers.DeepseekV3Config(
                **SHAPE,
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
            "KV layout is not the config's",
        ),
        (  # ALiBi in code of its own: no layer attends through the interface
            lambda: transformers.BloomConfig(vocab_size=261, hidden_size=64, n_layer=2, n_head=4),
            "0 of 2 layers attend through kvroute's paged kernels",
        ),
    ],
)
def test_unservable_models_are_refused_at_load(tmp_path: Path, config, field: str) -> None:  # type: ignore[no-untyped-def]
    path = write_model(config(), tmp_path / "m")
    with pytest.raises(UnsupportedModelError, match=field):
        LLM(str(path), num_blocks=16)


def test_gptj_is_refused_where_it_picks_attention_by_name_else_served_exactly(
    tmp_path: Path,
) -> None:
    """GPT-J chose its attention classes by name (``GPTJ_ATTENTION_CLASSES``, none for the
    paged kernels) up to transformers 5.19 at least, and is refused there; in 5.25 it
    attends through transformers' registry, and is served, token for token as
    transformers' own greedy output. Which one holds depends on the transformers pip
    installs: each is checked where it is the case."""
    from transformers.models.gptj import modeling_gptj

    config = transformers.GPTJConfig(
        vocab_size=261, n_embd=64, n_layer=2, n_head=4, n_positions=1024, rotary_dim=8
    )
    path = write_model(config, tmp_path / "m")
    if hasattr(modeling_gptj, "GPTJ_ATTENTION_CLASSES"):
        with pytest.raises(UnsupportedModelError, match="picks its attention classes by name"):
            LLM(str(path), num_blocks=16)
        return
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    hf.eval()
    cold, shared = _prompts(seed=3)
    llm = LLM(str(path), num_blocks=256, dtype="float32")
    _check(hf, cold + shared, llm.generate(cold + shared, GREEDY))
