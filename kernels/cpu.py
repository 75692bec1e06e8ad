"""The CPU path: the torch reference, with decodes through a C kernel that reads the paged
cache in place (``kernels/cpu_attention.c``) where it is built and the tensors fit it.

Why a separate module: the reference stays the definition (any dtype, any strides, fp64 in
tests), while the serving path on a CPU takes the fast kernel for the common case -- fp32
caches, contiguous rows -- and falls back to the reference for anything else.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kvroute.kernels import reference

__all__ = ["decode_kernel_available", "paged_attention", "store_kv"]

store_kv = reference.store_kv

try:  # optional, like kvroute.events._chain: built at install time where a C compiler exists
    from kvroute.kernels import _cpu_attention
except ImportError:  # pragma: no cover - a build without a compiler
    _cpu_attention = None

_DISABLE_ENV = "KVROUTE_CPU_DECODE_KERNEL"  # "0": decodes through the torch reference


def decode_kernel_available() -> bool:
    """Whether decodes may go through the C kernel in this process."""
    return _cpu_attention is not None and os.environ.get(_DISABLE_ENV, "1") != "0"


def _fits(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor) -> bool:
    return (
        query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and query.device.type == "cpu"
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and block_tables.dtype == torch.int32
        and block_tables.stride(1) == 1
    )


def decode(
    out: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    seqs: list[int],
    scale: float,
    sliding_window: int | None,
) -> None:
    """Sequences ``seqs`` (one new token each) through the C kernel, into ``out``."""
    assert _cpu_attention is not None
    selected = torch.tensor(seqs, dtype=torch.int32)
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    _cpu_attention.decode(
        out.data_ptr(),
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        lens.data_ptr(),
        starts.data_ptr(),
        selected.data_ptr(),
        len(seqs),
        query.shape[1],
        k_cache.shape[2],
        query.shape[2],
        k_cache.shape[1],
        block_tables.stride(0),
        query.stride(0),
        out.stride(0),
        scale,
        sliding_window or 0,
    )


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
    """Same contract as :func:`kvroute.kernels.reference.paged_attention`."""
    if not (decode_kernel_available() and _fits(query, k_cache, v_cache, block_tables)):
        return reference.paged_attention(
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
    qsl, lens = reference.check_batch(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len,
        sliding_window,
    )
    out = torch.empty(query.shape, dtype=query.dtype)
    out[qsl[-1] :].zero_()
    decodes = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    if len(decodes) > 1:  # siblings of one cached prefix back to back: its blocks stay in cache
        first = block_tables[:, 0].tolist()
        decodes.sort(key=first.__getitem__)
    if len(decodes) < len(lens):  # prefills and chunks: the reference's SDPA paths
        others = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] > 1]
        reference.attend_prefills(
            out, query, k_cache, v_cache, block_tables, qsl, lens, scale, sliding_window, others
        )
    if decodes:  # windowed or not: the kernel starts each walk at the window's edge
        decode(
            out,
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            decodes,
            scale,
            sliding_window,
        )
    return out
