"""The kernel backend is chosen once, when the engine is built: no ``KVROUTE_*`` variable is
read on a step, and each switch still selects what it says."""

from __future__ import annotations

import os
import types
from collections.abc import Iterator

import pytest

from kvroute.kernels import cpu
from kvroute.kernels.backends import CpuBackend, KernelBackend, TorchBackend
from kvroute.replica import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 9, 13, 40, 41, 42, 7], [3, 4] * 20, [100]]
SWITCHES = ("KVROUTE_KERNELS_BACKEND", "KVROUTE_CPU_DECODE_KERNEL", "KVROUTE_CPU_PREFILL_KERNEL")


class _GuardedEnviron(dict):  # type: ignore[type-arg]
    """``os.environ`` stand-in that records every KVROUTE_* name read through it."""

    def __init__(self, real: os._Environ[str], reads: list[str]) -> None:
        super().__init__(real)
        self.reads = reads

    def _note(self, key: object) -> None:
        if isinstance(key, str) and key.startswith("KVROUTE_"):
            self.reads.append(key)

    def __getitem__(self, key: str) -> str:
        self._note(key)
        return super().__getitem__(key)

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return super().__contains__(key)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


@pytest.mark.parametrize("model_impl", ["kvroute", "transformers"])
def test_no_environment_read_on_a_step(clean_env: pytest.MonkeyPatch, model_impl: str) -> None:
    """Prefill and decode steps of ``tiny`` after the engine is built read no KVROUTE_*
    variable (neither os.environ nor os.getenv), and give the tokens an unguarded run gives."""
    llm = LLM("tiny", dtype="float32", num_blocks=64, model_impl=model_impl)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    reads: list[str] = []
    clean_env.setattr(os, "environ", _GuardedEnviron(os.environ, reads))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert reads == [], f"read on a step: {sorted(set(reads))}"
    assert got == want


def _engine_backend(**env: str) -> tuple[LLM, KernelBackend]:
    llm = LLM("tiny", dtype="float32", num_blocks=64)
    runner = llm.llm_engine.runner
    assert runner.paged_decoder is not None and runner.paged_decoder.kernels is runner.kernels
    return llm, runner.kernels


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, "CpuBackend(decode_kernel=True, prefill_kernel=True)"),
        ({"KVROUTE_KERNELS_BACKEND": "torch"}, "TorchBackend()"),
        (
            {"KVROUTE_KERNELS_BACKEND": "triton"},
            "CpuBackend(decode_kernel=True, prefill_kernel=True)",
        ),
        (
            {"KVROUTE_CPU_DECODE_KERNEL": "0"},
            "CpuBackend(decode_kernel=False, prefill_kernel=True)",
        ),
        (
            {"KVROUTE_CPU_PREFILL_KERNEL": "0"},
            "CpuBackend(decode_kernel=True, prefill_kernel=False)",
        ),
        (
            {"KVROUTE_KERNELS_BACKEND": "torch", "KVROUTE_CPU_DECODE_KERNEL": "0"},
            "TorchBackend()",
        ),
    ],
)
def test_each_switch_selects_its_backend_when_the_engine_is_built(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], want: str
) -> None:
    if not (cpu.decode_kernel_available() and cpu.prefill_kernel_available()):
        want = want.replace("=True", "=False")  # a build without the C kernels
    for name, value in env.items():
        clean_env.setenv(name, value)
    _, backend = _engine_backend()
    assert repr(backend) == want
    assert isinstance(backend, TorchBackend if want.startswith("Torch") else CpuBackend)


def test_an_unknown_backend_is_refused_when_the_engine_is_built(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("KVROUTE_KERNELS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="KVROUTE_KERNELS_BACKEND must be torch, triton"):
        LLM("tiny", dtype="float32", num_blocks=64)


@pytest.mark.skipif(
    not (cpu.decode_kernel_available() and cpu.prefill_kernel_available()),
    reason="C kernels not built",
)
@pytest.mark.parametrize("off", [None, "KVROUTE_CPU_DECODE_KERNEL", "KVROUTE_CPU_PREFILL_KERNEL"])
def test_the_switch_read_at_build_decides_the_steps(
    clean_env: pytest.MonkeyPatch, off: str | None
) -> None:
    """The C kernels run on the steps unless switched off when the engine was built; setting
    the variable afterwards changes nothing; the tokens are the same either way."""
    plain = LLM("tiny", dtype="float32", num_blocks=64)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    if off is not None:
        clean_env.setenv(off, "0")
    llm, _ = _engine_backend()
    for name in SWITCHES[1:]:
        clean_env.setenv(name, "1" if name == off else "0")  # the opposite, too late to count
    calls = {"decode": 0, "prefill": 0}

    def counting(module: object, name: str) -> object:
        real = getattr(module, name)

        def call(*args: object) -> object:
            calls[name] += 1
            return real(*args)

        return types.SimpleNamespace(**{name: call})

    clean_env.setattr(cpu, "_cpu_attention", counting(cpu._cpu_attention, "decode"))
    clean_env.setattr(cpu, "_cpu_prefill", counting(cpu._cpu_prefill, "prefill"))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert (calls["decode"] > 0) == (off != "KVROUTE_CPU_DECODE_KERNEL")
    assert (calls["prefill"] > 0) == (off is None)  # decode off: everything the reference's
    assert got == want


def test_every_environment_variable_is_in_the_one_table() -> None:
    """docs/extending.md's table names every KVROUTE_* variable the code reads."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found: set[str] = set()
    for pattern in ("*.py", "*.c"):
        for path in root.rglob(pattern):
            if not {".git", "build", ".venv"} & set(path.relative_to(root).parts):
                found |= set(re.findall(r"KVROUTE_[A-Z_]*[A-Z]", path.read_text(errors="ignore")))
    found.discard("KVROUTE_DTYPES")  # a tuple of dtype names in deploy/serve_checks.py
    doc = (root / "docs" / "extending.md").read_text()
    table = doc[doc.index("## Environment variables") :]
    assert found and {name for name in found if name not in table} == set()


def test_every_environment_variable_is_named_by_a_test() -> None:
    """Each KVROUTE_* variable the library reads is named in some test file (a test that
    sets it, or one that holds its constant to the documented name)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    libraries = ("events", "replica", "kernels", "router", "sim", "deploy", "loadgen")
    name = r"\bKVROUTE_[A-Z0-9_]*[A-Z0-9]\b"  # not KVROUTE_CPU of "KVROUTE_CPU_*_KERNEL"
    read: set[str] = set()
    for lib in libraries:
        for pattern in ("*.py", "*.c"):
            for path in (root / lib).rglob(pattern):
                read |= set(re.findall(name, path.read_text(errors="ignore")))
    read.discard("KVROUTE_DTYPES")  # a tuple of dtype names in deploy/serve_checks.py
    named: set[str] = set()
    for path in (root / "tests").rglob("*.py"):
        named |= set(re.findall(name, path.read_text(errors="ignore")))
    assert read and read - named == set()
