"""LoRA adapters served exactly: each adapter's greedy tokens equal transformers + PEFT's.

Random adapters are made here on ``tiny`` with PEFT itself (``get_peft_model``, random
non-zero ``lora_B``, ``save_pretrained``) and differ in rank, alpha, rsLoRA, targets and
layers, so a slot, rank or target mixed up changes the tokens. The engine runs them alone,
four and the base model in one batch, over a cached prefix, in chunks, under preemption and
with fewer slots than adapters; the reference is PEFT's unmerged model, fp32.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvroute.events import BlockHasher
from kvroute.events.wire import BlockStored
from kvroute.kernels.lora import LoRAMapping, add_lora
from kvroute.replica import LLM, SamplingParams
from kvroute.replica.model import lora_store as lora_store_module
from kvroute.replica.model.lora_adapter import LoRAError
from kvroute.replica.model.model_runner import UnsupportedModelError
from kvroute.replica.model.models import tiny_model_path

from ..hf_reference import hf_greedy

peft = pytest.importorskip("peft")

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# name: LoraConfig arguments. Ranks 4-16, partial and full targets, rsLoRA, some layers only.
ADAPTERS: dict[str, dict[str, object]] = {
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all16": {
        "r": 16,
        "lora_alpha": 32,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    },
    "mlp4rs": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
    },
    "ko12": {
        "r": 12,
        "lora_alpha": 12,
        "target_modules": ["k_proj", "o_proj"],
        "layers_to_transform": [1, 3],
    },
}
NAMES = list(ADAPTERS)


def _make_adapter(out: Path, seed: int, **kwargs: object) -> Path:
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: an adapter that changes nothing
                param.normal_(0.0, 0.08)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(_make_adapter(root / name, seed, **kw))
        for seed, (name, kw) in enumerate(ADAPTERS.items(), start=1)
    }


@pytest.fixture(scope="module")
def reference(adapters: dict[str, str]) -> Callable[[str | None, list[int]], list[int]]:
    """transformers + PEFT's greedy tokens of a prompt under an adapter (None: the base)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapters[NAMES[0]], adapter_name=NAMES[0])
    for name in NAMES[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    cache: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}

    def greedy(adapter: str | None, prompt: list[int]) -> list[int]:
        key = (adapter, tuple(prompt))
        if key not in cache:
            if adapter is None:
                with model.disable_adapter():
                    cache[key] = hf_greedy(model, prompt, NEW_TOKENS)
            else:
                model.set_adapter(adapter)
                cache[key] = hf_greedy(model, prompt, NEW_TOKENS)
        return cache[key]

    return greedy


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Cold prompts of 1..90 tokens, and prompts over one 48-token prefix."""
    rng = random.Random(seed)
    cold = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 7, 20, 45, 90)]
    prefix = [rng.randrange(3, 256) for _ in range(48)]
    shared = [prefix + [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    return cold, shared


def _llm(adapters: dict[str, str], **kwargs: object) -> LLM:
    kwargs.setdefault("num_blocks", 256)
    kwargs.setdefault("max_loras", 4)
    return LLM("tiny", dtype="float32", lora_modules=dict(adapters), **kwargs)  # type: ignore[arg-type]


def _mixed(prompts: list[list[int]]) -> list[tuple[str | None, list[int]]]:
    """Every prompt under every adapter and the base, interleaved."""
    return [(a, p) for p in prompts for a in [None, *NAMES]]


def _run_and_check(llm: LLM, reference, jobs: list[tuple[str | None, list[int]]]):  # type: ignore[no-untyped-def]
    outs = llm.generate([{"prompt_token_ids": p, "lora_name": a} for a, p in jobs], GREEDY)
    for (adapter, prompt), out in zip(jobs, outs, strict=True):
        assert out.outputs[0].token_ids == reference(adapter, prompt), (adapter, len(prompt))
    return outs


@pytest.fixture
def step_adapters(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of distinct adapters in each step that had any."""
    seen: list[int] = []
    real = lora_store_module.LoRAStore.step

    def step(self, requests):  # type: ignore[no-untyped-def]
        keys = {k for k, _ in requests if k is not None}
        if keys:
            seen.append(len(keys))
        return real(self, requests)

    monkeypatch.setattr(lora_store_module.LoRAStore, "step", step)
    yield seen


def test_adapters_change_the_output(reference) -> None:  # type: ignore[no-untyped-def]
    """Each random adapter gives other tokens than the base: the tests below can fail."""
    cold, _ = _prompts(seed=1)
    for name in NAMES:
        differ = [reference(name, p) != reference(None, p) for p in cold]
        assert sum(differ) >= 3, name


def test_each_adapter_alone(adapters, reference) -> None:  # type: ignore[no-untyped-def]
    cold, _ = _prompts(seed=2)
    llm = _llm(adapters, max_loras=1)
    for name in NAMES:
        _run_and_check(llm, reference, [(name, p) for p in cold])


def test_four_adapters_and_the_base_in_one_batch(adapters, reference, step_adapters) -> None:  # type: ignore[no-untyped-def]
    cold, _ = _prompts(seed=3)
    llm = _llm(adapters)
    _run_and_check(llm, reference, _mixed(cold))
    assert max(step_adapters) == 4  # all four in one step, beside base rows


def test_over_a_cached_prefix(adapters, reference) -> None:  # type: ignore[no-untyped-def]
    _, shared = _prompts(seed=4)
    llm = _llm(adapters)
    _run_and_check(llm, reference, _mixed(shared[:1]))
    outs = _run_and_check(llm, reference, _mixed(shared[1:]))
    assert all(o.num_cached_tokens == 48 for o in outs)


def test_chunked_prefill(adapters, reference, step_adapters) -> None:  # type: ignore[no-untyped-def]
    cold, shared = _prompts(seed=5)
    llm = _llm(adapters, max_num_batched_tokens=24)
    _run_and_check(llm, reference, _mixed(cold[2:] + shared))
    assert max(step_adapters) >= 2


def test_preempted(adapters, reference) -> None:  # type: ignore[no-untyped-def]
    cold, shared = _prompts(seed=6)
    llm = _llm(adapters, num_blocks=16, max_num_batched_tokens=512)
    _run_and_check(llm, reference, _mixed(cold[2:] + shared))
    assert llm.llm_engine.stats()["num_preemptions"] > 0


def test_fewer_slots_than_adapters(adapters, reference, step_adapters) -> None:  # type: ignore[no-untyped-def]
    """Two slots, two adapters in host memory, four adapters in one batch: no step mixes
    more than two; adapters move through slots and host memory and stay exact."""
    cold, _ = _prompts(seed=7)
    llm = _llm(adapters, max_loras=2, max_cpu_loras=2)
    _run_and_check(llm, reference, _mixed(cold))
    assert max(step_adapters) == 2
    stats = llm.llm_engine.lora.stats  # type: ignore[union-attr]
    assert stats.host_evictions > 0 and stats.loads > len(NAMES)


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256_cbor_tagged"])
def test_adapters_never_share_blocks(adapters, algo: str) -> None:  # type: ignore[no-untyped-def]
    """The same prompt under two adapters and the base: three sets of blocks; under the same
    adapter again, a hit."""
    prompt = list(range(3, 3 + 64))
    llm = _llm(adapters, hash_algo=algo)
    engine = llm.llm_engine
    events: list[object] = []
    engine.event_sinks.append(events.extend)

    def cached(adapter: str | None) -> int:
        [out] = llm.generate([{"prompt_token_ids": prompt, "lora_name": adapter}], GREEDY)
        return out.num_cached_tokens

    assert [cached("qv8"), cached("all16"), cached(None)] == [0, 0, 0]
    assert [cached("qv8"), cached("all16"), cached(None)] == [48, 48, 48]
    hasher = BlockHasher(algo, engine.config.hash_seed, engine.config.block_size)
    chains = [
        hasher.hash_blocks(prompt, lora_name=name, lora_path=adapters[name] if name else None)
        for name in ("qv8", "all16", None)
    ]
    assert not set(chains[0]) & set(chains[1]) and not set(chains[0]) & set(chains[2])
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.lora_name for e in stored] == ["qv8", "all16", None] * 2  # the events name it


def test_a_slow_adapter_read_does_not_stall_others(adapters, reference, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """While an adapter is read from disk, base requests and requests of adapters in memory
    keep stepping; the waiting request runs once its adapter is in."""
    llm = _llm(adapters, max_loras=2)
    engine = llm.llm_engine
    cold, _ = _prompts(seed=8)
    release = threading.Event()
    real = lora_store_module.load_adapter

    def slow(name, spec, dtype):  # type: ignore[no-untyped-def]
        if name == "all16":
            assert release.wait(30)
        return real(name, spec, dtype)

    monkeypatch.setattr(lora_store_module, "load_adapter", slow)
    engine.add_request("slow", cold[3], GREEDY, lora_name="all16")
    engine.add_request("base", cold[2], GREEDY)
    engine.add_request("qv8", cold[4], GREEDY, lora_name="qv8")
    done: dict[str, list[int]] = {}
    for _ in range(200):
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if {"base", "qv8"} <= done.keys():
            break
    assert {"base", "qv8"} <= done.keys() and "slow" not in done
    assert engine.scheduler.requests["slow"].num_computed_tokens == 0
    release.set()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert done["slow"] == reference("all16", cold[3])
    assert done["base"] == reference(None, cold[2])
    assert done["qv8"] == reference("qv8", cold[4])


def test_an_adapter_that_fails_to_load_fails_its_requests_alone(adapters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    broken = shutil.copytree(adapters["qv8"], tmp_path / "broken")
    llm = _llm({"broken": str(broken)})
    (broken / "adapter_model.safetensors").write_bytes(b"gone")  # after registration
    engine = llm.llm_engine
    engine.add_request("bad", [5, 6, 7], GREEDY, lora_name="broken")
    engine.add_request("ok", [5, 6, 7], GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    bad, ok = outs["bad"].outputs[0], outs["ok"].outputs[0]
    assert bad.finish_reason == "error" and "LoRA" in (bad.error or "")
    assert ok.finish_reason == "length"


def _edited(src: str, dst: Path, **fields: object) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(fields)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 64}, "max_lora_rank"),
    ],
)
def test_unsupported_adapters_are_refused_naming_the_field(
    adapters, tmp_path, fields, named
) -> None:  # type: ignore[no-untyped-def]
    llm = _llm({}, enable_lora=True, max_lora_rank=32)
    path = _edited(adapters["qv8"], tmp_path / "a", **fields)
    with pytest.raises(LoRAError, match=named):
        llm.llm_engine.add_lora("a", path)
    assert llm.llm_engine.list_loras() == {}


def test_requests_name_only_registered_adapters(adapters) -> None:  # type: ignore[no-untyped-def]
    llm = _llm({"qv8": adapters["qv8"]})
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.add_request("x", [1, 2, 3], GREEDY, lora_name="nope")
    assert engine.remove_lora("qv8") and engine.list_loras() == {}
    with pytest.raises(ValueError, match="unknown LoRA adapter 'qv8'"):
        engine.add_request("y", [1, 2, 3], GREEDY, lora_name="qv8")
    plain = LLM("tiny", num_blocks=16)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.llm_engine.add_request("z", [1, 2, 3], GREEDY, lora_name="qv8")


def test_transformers_impl_refuses_lora(adapters) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedModelError, match="model_impl 'kvroute'"):
        _llm(adapters, model_impl="transformers")


@pytest.mark.parametrize(
    ("kernel", "row_slot", "runs_as"),
    [
        ("grouped", [2, -1, 0, 2, 4, -1, 0, 2, 2, 4, -1], "grouped"),  # slots of unequal height
        ("grouped", [1, 2, -1, 2, 1, 3, 3, -1, 1, 2, 3], "padded"),  # a decode batch's spread
        ("dense", [2, -1, 0, 2, 4, -1, 0, 2, 2, 4, -1], "dense"),
    ],
)
def test_grouped_kernel_equals_one_row_at_a_time(
    kernel: str, row_slot: list[int], runs_as: str
) -> None:
    """Rows of several slots and the base, in any order, some slots empty; three targets."""
    gen = torch.Generator().manual_seed(0)
    slots, fan_in, rank, outs = 5, 24, 4, [16, 8, 8]
    a = torch.randn(slots, fan_in, rank * len(outs), generator=gen)
    bs = [torch.randn(slots, rank, o, generator=gen) for o in outs]
    x = torch.randn(len(row_slot), fan_in, generator=gen)
    y = torch.randn(len(row_slot), sum(outs), generator=gen)
    want = y.clone()
    for t, s in enumerate(row_slot):
        if s >= 0:
            u = x[t] @ a[s]
            want[t] += torch.cat([u[i * rank : (i + 1) * rank] @ b[s] for i, b in enumerate(bs)])
    spans = [(s, t, 1) for t, s in enumerate(row_slot) if s >= 0]
    mapping = LoRAMapping.build(spans, slots, torch.device("cpu"), kernel)
    assert mapping is not None and mapping.kernel == runs_as
    add_lora(y, x, a, bs, mapping)
    torch.testing.assert_close(y, want)
    assert LoRAMapping.build([], slots, torch.device("cpu"), kernel) is None
