"""A decoder layer's elementwise ops on CPU in C (``kernels/cpu_layer_ops.c`` says why).

Each function takes float32 CPU tensors whose rows are contiguous in their last dimension;
:func:`usable` says whether this process has the extension (built at install time where a
C compiler exists) and whether ``KVROUTE_CPU_LAYER_OPS=0`` turned it off. Callers keep
their torch path for everything else.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # optional, like the attention kernel
    from kvroute.kernels import _cpu_layer_ops
except ImportError:  # pragma: no cover - a build without a compiler
    _cpu_layer_ops = None

__all__ = ["add_rms_norm", "rms_norm_heads_", "rotary_", "silu_mul", "usable"]

_ENV = "KVROUTE_CPU_LAYER_OPS"


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        _cpu_layer_ops is not None
        and device.type == "cpu"
        and dtype == torch.float32
        and os.environ.get(_ENV, "1") != "0"
    )


def _rows(t: Tensor) -> None:
    if t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError("float32 rows, contiguous in the last dimension, expected")


def add_rms_norm(residual: Tensor, x: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """``residual += x`` in place (``x`` None: nothing added), then RMSNorm of it times
    ``weight``, as transformers' LlamaRMSNorm computes it in fp32."""
    _rows(residual)
    rows, cols = residual.shape
    if x is not None:
        _rows(x)
        if x.shape != residual.shape:
            raise ValueError("x and residual differ in shape")
    if weight.shape != (cols,) or not weight.is_contiguous():
        raise ValueError("weight must be one contiguous row of the residual's width")
    out = torch.empty_like(residual)
    assert _cpu_layer_ops is not None
    _cpu_layer_ops.add_rms_norm(
        residual.data_ptr(),
        x.data_ptr() if x is not None else 0,
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        cols,
        residual.stride(0),
        x.stride(0) if x is not None else 0,
        out.stride(0),
        eps,
    )
    return out


def rms_norm_heads_(x: Tensor, weight: Tensor, heads: int, head_dim: int, eps: float) -> None:
    """RMSNorm of each of the first ``heads`` heads of each row of ``x`` [tokens, >=
    heads*head_dim], in place, times ``weight`` [head_dim] (Qwen3's q_norm / k_norm)."""
    _rows(x)
    if x.shape[1] < heads * head_dim:
        raise ValueError("x is narrower than its heads")
    if weight.shape != (head_dim,) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"weight must be one contiguous float32 row of {head_dim}")
    assert _cpu_layer_ops is not None
    _cpu_layer_ops.rms_norm_heads(
        x.data_ptr(), weight.data_ptr(), x.shape[0], heads, head_dim, x.stride(0), eps
    )


def silu_mul(gate_up: Tensor) -> Tensor:
    """SiLU of each row's first half times its second half: [rows, 2I] -> [rows, I]."""
    _rows(gate_up)
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    assert _cpu_layer_ops is not None
    _cpu_layer_ops.silu_mul(
        gate_up.data_ptr(), out.data_ptr(), rows, inter, gate_up.stride(0), inter
    )
    return out


def rotary_(x: Tensor, cos: Tensor, sin: Tensor, heads: int, head_dim: int) -> None:
    """Rotates the first ``heads`` heads of each row of ``x`` [tokens, >= heads*head_dim]
    in place; ``cos``/``sin`` are [tokens, head_dim] (transformers' rotary module's)."""
    _rows(x)
    for t in (cos, sin):
        _rows(t)
        if t.shape != (x.shape[0], head_dim):
            raise ValueError(f"cos/sin must be [tokens, {head_dim}]")
    if cos.stride(0) != sin.stride(0) or x.shape[1] < heads * head_dim:
        raise ValueError("cos/sin strides differ, or x is narrower than its heads")
    assert _cpu_layer_ops is not None
    _cpu_layer_ops.rotary(
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        x.shape[0],
        heads,
        head_dim,
        x.stride(0),
        cos.stride(0),
    )
