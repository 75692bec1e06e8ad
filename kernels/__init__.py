"""Paged-attention and KV-store kernels: a plain-torch reference (the definition, tests),
the CPU path (the reference with a C decode kernel) and Triton (GPU).

``store_kv`` and ``paged_attention`` dispatch on the tensors: CUDA tensors go to the Triton
kernels when Triton imports, CPU tensors to :mod:`.cpu`. All paths share one signature.
``KVROUTE_KERNELS_BACKEND=torch`` forces the reference everywhere (to bisect a kernel bug);
``=triton`` makes a missing Triton an error instead of a silent fallback.

Triton is imported lazily and only when CUDA is available: importing it (and its autotuner)
on a machine without a GPU can fail.
"""

from __future__ import annotations

import sys

if __name__ != "kvroute.kernels":
    # Found as a top-level `kernels` (a checkout's root on sys.path: `python -m` or `-c` run
    # from it), e.g. by transformers probing for PyPI's `kernels`: answer "not installed".
    # None in sys.modules makes this import return None, and find_spec and import say so.
    sys.modules[__name__] = None  # type: ignore[assignment]

import functools
import os
from types import ModuleType

import torch
from torch import Tensor

from kvroute.kernels import cpu, reference
from kvroute.kernels.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "available_backends",
    "paged_attention",
    "reference",
    "store_kv",
]

_ENV = "KVROUTE_KERNELS_BACKEND"


_triton_error: list[BaseException] = []  # why Triton is unusable, for the error message


@functools.cache
def _triton_module() -> ModuleType | None:
    """The Triton kernels module, or None where CUDA or Triton is missing or broken."""
    if not torch.cuda.is_available():
        return None
    try:
        from kvroute.kernels import triton_kernels
    except Exception as exc:  # not only ImportError: a broken install can raise anything
        _triton_error.append(exc)
        return None
    return triton_kernels


def available_backends() -> list[str]:
    """Backends usable in this process: always "torch", plus "triton" with CUDA and Triton."""
    return ["torch"] + (["triton"] if _triton_module() is not None else [])


def _backend(t: Tensor) -> ModuleType:
    choice = os.environ.get(_ENV, "").strip().lower()
    if choice == "torch":
        return reference
    if not t.is_cuda:
        return cpu
    mod = _triton_module()
    if mod is None:
        if choice == "triton":
            why = f": {_triton_error[0]!r}" if _triton_error else ""
            raise RuntimeError(f"{_ENV}=triton but Triton is not usable{why}")
        return reference
    return mod


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
    *,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Bottom-right causal attention of a flattened varlen batch over the paged cache.

    query: [num_tokens, num_heads, head_dim]; sequence i's new tokens are
    ``query[query_start_loc[i]:query_start_loc[i+1]]`` at positions
    ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``, already stored by ``store_kv``. GQA when
    num_heads is a multiple of num_kv_heads. ``sliding_window`` W: a query at position p
    sees keys p - W + 1 .. p (transformers' and vLLM's convention); None sees all.
    Returns [num_tokens, num_heads, head_dim] in ``query.dtype``, accumulated in fp32 (rows
    past the last sequence are zero).
    """
    return _backend(query).paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        scale=scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        sliding_window=sliding_window,
    )
