"""Projections with weights prepacked for oneDNN, on CPU replicas.

Why: a decode step multiplies a few rows by every weight of the model, so it streams the
weights from memory once per step. torch's ``F.linear`` hands MKL the weight as it is and
MKL repacks it on every call; oneDNN's linear with a weight reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what Inductor uses
for CPU linears) skips that. BENCHMARKS.md has the figures (``bench_decode_step``).

Used where it applies and checked at load: a float32 CPU weight, torch built with
oneDNN, and the packed product equal to ``F.linear`` on a probe input (else the weight is
kept as it is). ``KVROUTE_CPU_PREPACK=0`` turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

__all__ = ["Linear", "prepack_available"]

_ENV = "KVROUTE_CPU_PREPACK"


def prepack_available(weight: Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and os.environ.get(_ENV, "1") != "0"
    )


def _probe_ok(weight: Tensor, bias: Tensor | None, packed: Tensor) -> bool:
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    want = F.linear(x, weight, bias)
    got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    scale = float(want.abs().max()) or 1.0
    return got.shape == want.shape and float((got - want).abs().max()) <= 1e-5 * scale


class Linear:
    """``y = x @ weight.T + bias``; the weight prepacked for oneDNN where that applies."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, prepack: bool = True) -> None:
        self.weight: Tensor | None = weight.detach()
        self.bias = bias.detach() if bias is not None else None
        self.packed: Tensor | None = None
        if prepack and prepack_available(weight):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
            except RuntimeError:  # an op this torch build lacks: plain F.linear
                return
            if _probe_ok(self.weight, self.bias, packed):
                self.packed, self.weight = packed, None  # one copy kept, the packed one

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
