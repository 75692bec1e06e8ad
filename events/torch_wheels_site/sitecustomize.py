"""Run by Python's ``site`` at the start of every interpreter whose ``PYTHONPATH`` names
this folder (:func:`kvroute.events.torch_wheels.hide_in_subprocesses` puts it there): hides
the torch companions that cannot load beside torch, before the main module imports
anything -- e.g. in vLLM's ``python -m vllm.model_executor.models.registry`` child.

This folder holds nothing else, so being on ``sys.path`` adds no other top-level name.
Python imports only the first ``sitecustomize`` it finds, and this one comes before the
interpreter's own (``PYTHONPATH`` precedes site-packages): that one, if any, is run
after, under its own name, as if this one were not here. An interpreter without kvroute
(another environment's, inheriting the variable) only runs its own.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _hide_broken() -> None:
    try:
        from kvroute.events.torch_wheels import hide_broken
    except ImportError:  # an interpreter without kvroute inherited the variable
        return
    hide_broken()


def _run_shadowed() -> None:
    """The ``sitecustomize`` this one shadows, found on the rest of ``sys.path``."""
    me = os.path.realpath(__file__)
    here = os.path.dirname(me)
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec(__name__, rest)
    if spec is None or spec.loader is None or os.path.realpath(spec.origin or "") == me:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


try:
    _hide_broken()
finally:
    _run_shadowed()
