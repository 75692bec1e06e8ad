"""Triton LoRA shrink and expand for CUDA: ``kvroute.kernels.lora``'s ``triton`` kernel.

Imported only when that kernel is chosen (CUDA with Triton, or ``KVROUTE_LORA_KERNEL=triton``
under Triton's CPU interpreter in tests), never at package import.

Design, as punica's SGMV: the rows that use an adapter are already grouped by slot
(:class:`kvroute.kernels.lora.LoRAMapping`), and the host cuts each slot's group into
tiles of ``BLOCK_M`` rows that never cross a slot, so a program owns one tile and one
block of output columns and reads one slot's weights:

* shrink: ``u[tile] = x[rows of tile] @ A[slot]`` -- the rows are gathered by index in the
  load, ``in`` walked ``BLOCK_K`` at a time, fp32 accumulation (tensor cores for bf16 and
  fp16, full-precision products for fp32); ``u`` is fp32;
* expand, per target of the projection group: ``y[rows, cols] += u[tile, rank slice] @
  B_t[slot]``, read-add-write on ``y`` (each row appears once in a batch, so no two
  programs write one element).

A decode batch (one row per request) gets mostly partial tiles: rows are masked, so a
tile of one row costs a matrix-vector product's loads plus the masked lanes. The grid is
sized from the host's tile count; no device sync, no autotuning (a replica's first step
must not stall on a sweep).
"""

# Triton's convention: compile-time (tl.constexpr) parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["BLOCK_M", "add_lora"]

BLOCK_M = 16  # rows per tile (tl.dot's smallest M)
_BLOCK_K = 32
_BLOCK_N = 64


@triton.jit
def _tile(rows_ptr, tile_start_ptr, tile_end_ptr, tile_slot_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its positions in the grouped rows, which of them are real, the
    batch rows they stand for, and the slot whose weights they all use."""
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    return offs_m, mask_m, rows, slot


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    u_ptr,
    rows_ptr,
    tile_start_ptr,
    tile_end_ptr,
    tile_slot_ptr,
    K,
    R,
    stride_x,
    stride_as,
    stride_ak,
    stride_u,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_m, mask_m, rows, slot = _tile(
        rows_ptr, tile_start_ptr, tile_end_ptr, tile_slot_ptr, BLOCK_M
    )
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        at = tl.load(
            a_ptr + slot * stride_as + offs_k[:, None] * stride_ak + offs_r[None, :],
            mask=mask_k[:, None] & mask_r[None, :],
            other=0.0,
        )
        if IEEE:  # fp32 weights: full precision, as the torch path
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:  # bf16 / fp16: tensor cores, fp32 accumulation
            acc += tl.dot(xt, at)
    tl.store(
        u_ptr + offs_m[:, None] * stride_u + offs_r[None, :],
        acc,
        mask=mask_m[:, None] & mask_r[None, :],
    )


@triton.jit
def _expand_kernel(
    u_ptr,
    b_ptr,
    y_ptr,
    rows_ptr,
    tile_start_ptr,
    tile_end_ptr,
    tile_slot_ptr,
    rank,
    N,
    u_col,
    y_col,
    stride_u,
    stride_bs,
    stride_br,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    offs_m, mask_m, rows, slot = _tile(
        rows_ptr, tile_start_ptr, tile_end_ptr, tile_slot_ptr, BLOCK_M
    )
    offs_r = tl.arange(0, BLOCK_RANK)
    mask_r = offs_r < rank
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ut = tl.load(
        u_ptr + offs_m[:, None] * stride_u + u_col + offs_r[None, :],
        mask=mask_m[:, None] & mask_r[None, :],
        other=0.0,
    )
    bt = tl.load(
        b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
        mask=mask_r[:, None] & mask_n[None, :],
        other=0.0,
    )
    if IEEE:
        d = tl.dot(ut, bt.to(tl.float32), input_precision="ieee")
    else:
        d = tl.dot(ut.to(bt.dtype), bt)
    where = y_ptr + rows[:, None] * stride_y + y_col + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(where, mask=mask, other=0.0)
    tl.store(where, (y.to(tl.float32) + d).to(y.dtype), mask=mask)


def tiles(by_slot: Sequence[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
    """(starts, ends, slots) of ``BLOCK_M``-row tiles over slot groups given as (slot,
    first index in the grouped rows, row count); no tile crosses a slot."""
    starts: list[int] = []
    ends: list[int] = []
    slots: list[int] = []
    for slot, first, count in by_slot:
        for s in range(first, first + count, BLOCK_M):
            starts.append(s)
            ends.append(min(s + BLOCK_M, first + count))
            slots.append(slot)
    return starts, ends, slots


def add_lora(
    y: Tensor,
    x: Tensor,
    a: Tensor,
    bs: Sequence[Tensor],
    rows: Tensor,
    tile_start: Tensor,
    tile_end: Tensor,
    tile_slot: Tensor,
) -> None:
    """``y[rows] += [x @ A_t @ B_t per target, side by side]`` per row's slot, in place;
    the layout of :func:`kvroute.kernels.lora.add_lora`. ``a``: [slots, in, R]; each ``b``
    [slots, rank, out_t]; tiles from :func:`tiles`, as device int32 tensors."""
    num_tiles = tile_start.shape[0]
    if num_tiles == 0:
        return
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.stride(2) == 1
    k_in, r_total = a.shape[1], a.shape[2]
    n_rows = rows.shape[0]
    ieee = x.dtype == torch.float32
    u = torch.empty(n_rows, r_total, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(min(r_total, 128)))
    _shrink_kernel[(num_tiles, triton.cdiv(r_total, block_r))](
        x,
        a,
        u,
        rows,
        tile_start,
        tile_end,
        tile_slot,
        k_in,
        r_total,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        u.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_K=_BLOCK_K,
        BLOCK_R=block_r,
        IEEE=ieee,
    )
    rank = bs[0].shape[1]
    block_rank = max(16, triton.next_power_of_2(rank))
    col = 0
    for t, b in enumerate(bs):
        assert b.stride(2) == 1
        n_out = b.shape[2]
        _expand_kernel[(num_tiles, triton.cdiv(n_out, _BLOCK_N))](
            u,
            b,
            y,
            rows,
            tile_start,
            tile_end,
            tile_slot,
            rank,
            n_out,
            t * rank,
            col,
            u.stride(0),
            b.stride(0),
            b.stride(1),
            y.stride(0),
            BLOCK_M=BLOCK_M,
            BLOCK_RANK=block_rank,
            BLOCK_N=_BLOCK_N,
            IEEE=ieee,
        )
        col += n_out
