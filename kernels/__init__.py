"""Paged-attention and KV-store kernels: a plain-torch reference (the definition, tests),
the CPU path (the reference with C decode and prefill kernels) and Triton (GPU).

The engine's model runner picks one :class:`~kvroute.kernels.backends.KernelBackend` when it
is built (:func:`select_backend`, the only reader of ``KVROUTE_KERNELS_BACKEND``,
``KVROUTE_CPU_DECODE_KERNEL`` and ``KVROUTE_CPU_PREFILL_KERNEL``) and every layer calls its
methods. The module-level ``store_kv`` and ``paged_attention`` (tests, benchmarks) use
:func:`default_backend` for the tensors' device type, chosen at its first call. All paths
share one signature.
"""

from __future__ import annotations

import sys

if __name__ != "kvroute.kernels":
    # Found as a top-level `kernels` (a checkout's root on sys.path: `python -m` or `-c` run
    # from it), e.g. by transformers probing for PyPI's `kernels`: answer "not installed".
    # None in sys.modules makes this import return None, and find_spec and import say so.
    sys.modules[__name__] = None  # type: ignore[assignment]

import functools

import torch
from torch import Tensor

from kvroute.kernels import backends, cpu, reference
from kvroute.kernels.backends import KernelBackend, select_backend
from kvroute.kernels.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "KernelBackend",
    "available_backends",
    "backends",
    "cpu",
    "default_backend",
    "paged_attention",
    "reference",
    "select_backend",
    "store_kv",
]


def available_backends() -> list[str]:
    """Backends usable in this process: always "torch", plus "triton" with CUDA and Triton."""
    return ["torch"] + (["triton"] if backends._triton_module() is not None else [])


@functools.cache
def default_backend(device_type: str) -> KernelBackend:
    """The backend the module-level functions use for tensors on ``device_type``: chosen
    by :func:`select_backend` at the first call for that device type, then kept (the
    engine's model runner chooses its own when it is built; ``default_backend.cache_clear()``
    makes the next call choose again)."""
    return select_backend(torch.device(device_type))


def _backend(t: Tensor) -> KernelBackend:
    return default_backend(t.device.type)


def store_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write each token's K/V to ``slot_mapping[i]`` of one layer's cache; negative = skip.

    key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim]; slot = block_id * block_size + offset (int64).
    """
    _backend(k_cache).store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Bottom-right causal attention of a flattened varlen batch over the paged cache.

    query: [num_tokens, num_heads, head_dim]; with ``meta``'s index tensors, sequence i's
    new tokens are ``query[query_start_loc[i]:query_start_loc[i+1]]`` at positions
    ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``, already stored by ``store_kv``
    (:meth:`AttentionMetadata.of` wraps bare tensors). GQA when num_heads is a multiple of
    num_kv_heads. ``sliding_window`` W: a query at position p sees keys p - W + 1 .. p
    (transformers' and vLLM's convention); None sees all. Returns [num_tokens, num_heads,
    head_dim] in ``query.dtype``, accumulated in fp32 (rows past the last sequence are zero).
    """
    return _backend(query).paged_attention(
        query, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
    )
