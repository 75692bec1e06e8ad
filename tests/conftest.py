"""Session-wide settings that must precede every import of the code under test."""

from __future__ import annotations

import os

import torch

# Without CUDA, Triton's interpreter runs the GPU kernels' tests on the CPU. Triton reads
# the variable when a kernel is decorated, so it is set here, before any test module
# imports the kernels; an explicit value (e.g. "0") is respected. The engine itself uses
# Triton only on CUDA, so nothing else changes.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
