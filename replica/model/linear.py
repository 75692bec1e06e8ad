"""Projections with weights packed once at load, on CPU replicas.

Why: a decode step multiplies a few rows by every weight of the model, so it streams the
weights from memory once per step, and how fast a step is depends on how close that
stream runs to the memory's bandwidth. torch's ``F.linear`` hands MKL the weight as it is
and MKL repacks it on every call. Two packed forms, the first that applies:

- one torch thread (a CPU replica's usual share): kvroute's tiled layout and C kernel
  (:mod:`kvroute.kernels.cpu_linear`), near the bandwidth at a few rows and as fast as
  oneDNN at hundreds;
- otherwise oneDNN's linear with a weight reordered once (``torch.ops.mkldnn.
  _reorder_linear_weight`` / ``_linear_pointwise``, what Inductor uses for CPU linears),
  threaded.

Each is checked at load against ``F.linear`` on a probe input, else the weight is kept as
it is. BENCHMARKS.md has the figures (``bench_decode_step``). ``KVROUTE_CPU_LINEAR=0``
turns the first off, ``KVROUTE_CPU_PREPACK=0`` both.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from kvroute.kernels import cpu_linear

__all__ = ["Linear", "prepack_available"]

_ENV = "KVROUTE_CPU_PREPACK"


def prepack_available(weight: Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and os.environ.get(_ENV, "1") != "0"
    )


def _probe_ok(weight: Tensor, bias: Tensor | None, project: object) -> bool:
    """The packed product equals ``F.linear`` on a probe of 3 and of 11 rows (the C
    kernel's row chunks: 8 + 2 + 1)."""
    gen = torch.Generator().manual_seed(0)
    for rows in (3, 11):
        x = torch.randn(rows, weight.shape[1], generator=gen)
        want = F.linear(x, weight, bias)
        got = project(x)  # type: ignore[operator]
        scale = float(want.abs().max()) or 1.0
        if got.shape != want.shape or float((got - want).abs().max()) > 1e-5 * scale:
            return False
    return True


class Linear:
    """``y = x @ weight.T + bias``; the weight packed where that applies (module doc)."""

    __slots__ = ("bias", "form", "out_features", "packed", "weight")

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, prepack: bool = True) -> None:
        self.weight: Tensor | None = weight.detach()
        self.bias = bias.detach() if bias is not None else None
        self.out_features = int(weight.shape[0])
        self.packed: Tensor | None = None
        self.form = "plain"  # "tiled" (kvroute's kernel), "onednn", or "plain" (F.linear)
        if not (prepack and prepack_available(weight)):
            return
        w = self.weight
        if cpu_linear.usable(w):
            if self.bias is not None:
                self.bias = self.bias.contiguous()
            self.packed, self.form = cpu_linear.pack(w), "tiled"
            if _probe_ok(w, self.bias, self):
                self.weight = None  # one copy kept, the packed one
                return
        try:
            self.packed, self.form = torch.ops.mkldnn._reorder_linear_weight(w), "onednn"
        except RuntimeError:  # an op this torch build lacks: plain F.linear
            self.packed, self.form = None, "plain"
            return
        if _probe_ok(w, self.bias, self):
            self.weight = None
        else:
            self.packed, self.form = None, "plain"

    def __call__(self, x: Tensor) -> Tensor:
        if self.form == "tiled":
            return cpu_linear.linear(x, self.packed, self.bias, self.out_features)  # type: ignore[arg-type]
        if self.form == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
