"""Linear layers on one CPU thread from weights packed in 32-output tiles
(``kernels/cpu_linear.c`` says why and what the layout is).

:func:`usable` says whether this process has the extension (built at install time where a
C compiler exists), whether ``KVROUTE_CPU_LINEAR=0`` turned it off, and whether the
engine runs one torch thread: the kernel is single-threaded, so with more threads
oneDNN's parallel GEMM serves instead.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # optional, like the attention kernel
    from kvroute.kernels import _cpu_linear
except ImportError:  # pragma: no cover - a build without a compiler
    _cpu_linear = None

__all__ = ["TILE", "isa", "linear", "pack", "usable"]

TILE = 32  # outputs per tile, as the C kernel's NT
_ENV = "KVROUTE_CPU_LINEAR"


def usable(weight: Tensor) -> bool:
    return (
        _cpu_linear is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.get_num_threads() == 1
        and os.environ.get(_ENV, "1") != "0"
    )


def isa() -> str | None:
    """The instruction set the kernel runs with here (None: no extension)."""
    return _cpu_linear.isa() if _cpu_linear is not None else None


def pack(weight: Tensor) -> Tensor:
    """[N, K] -> [ceil(N / 32), K, 32]: each tile of 32 outputs k-major, zero-padded."""
    n, k = weight.shape
    tiles = -(-n // TILE)
    padded = weight.new_zeros((tiles * TILE, k))
    padded[:n] = weight
    return padded.view(tiles, TILE, k).transpose(1, 2).contiguous()


def linear(x: Tensor, packed: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """``x @ W.T + bias`` for ``packed = pack(W)``; x is [rows, K] (or [..., K])."""
    k = packed.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != k or x.device.type != "cpu":
        raise ValueError(f"float32 CPU input of width {k} expected, got {x.dtype} {x.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, n), dtype=torch.float32)
    if rows:
        assert _cpu_linear is not None
        _cpu_linear.linear(
            y.data_ptr(),
            x2.data_ptr(),
            packed.data_ptr(),
            bias.data_ptr() if bias is not None else 0,
            rows,
            k,
            n,
            x2.stride(0),
            n,
        )
    return y.view(*lead, n)
