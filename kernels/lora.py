"""Grouped LoRA products for one batch that mixes several adapters and the base model.

What: ``y[t] += (x[t] @ A[s]) @ B[s]`` for every row ``t`` of the batch whose request uses
the adapter in slot ``s``; rows of the base model are left alone. "Shrink" (``x @ A``,
width ``in`` to the rank) then "expand" (back to ``out``), as punica's SGMV/BGMV and
S-LoRA do.

Why grouped: a batch mixes many requests, each under its own adapter or none. Splitting it
into per-adapter sub-batches costs a Python round of ops per adapter per projection per
layer; instead, the rows that use an adapter are gathered once, sorted by slot
(:class:`LoRAMapping`, built once per step and shared by every layer), and each shrink and
each expand is ONE call over all of them: torch's ``grouped_mm`` (one GEMM per slot, run
inside one op), then one ``index_add_`` puts the products back on their rows. The two
alternatives tried on CPU were slower: gathering each row's adapter weights for a batched
matrix-vector product (BGMV as such; it copies every row's weights) and a Python loop over
slots. ``benchmarks/bench_lora_step.py`` measures this path against ``dense`` (below).

Layout (one layer's projection group, e.g. the fused QKV; see ``replica/model/lora_store.py``):
``a`` is ``[slots, in, targets * rank]`` -- each target's ``A.T`` side by side, so the
group's targets share one shrink -- and ``bs`` holds per target ``[slots, rank, out_t]``
(``B.T`` times the adapter's scaling); the expand outputs of the group's targets are its
columns in order, as the fused projection's. Ranks smaller than ``rank`` are zero-padded.

Kernels, chosen per device (:func:`kernel_for`) and, on CPU, per step
(:meth:`LoRAMapping.build`): ``padded`` when the slots in use hold about as many rows each
(a decode batch spread over its adapters): one batched GEMM (``bmm``) over those slots,
each padded to the fullest; ``grouped`` otherwise: torch's ``grouped_mm``, which runs one
GEMM per slot and pays a host round for each. ``dense`` (devices other than the CPU): each
gathered row multiplies every slot's weights in one batched product and keeps its own
slot's result: the same numbers for slots times the work, in ops every device has.
``triton`` (CUDA): SGMV-style shrink and expand kernels over tiles of rows that never cross
a slot (``kernels/lora_triton.py``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

__all__ = ["LoRAMapping", "add_lora", "kernel_for"]

_ENV = "KVROUTE_LORA_KERNEL"
KERNELS = ("grouped", "dense", "triton")


def kernel_for(device: torch.device) -> str:
    """``grouped`` on CPU (torch's grouped_mm takes any float dtype there), ``triton`` on
    CUDA where Triton imports, ``dense`` elsewhere; ``KVROUTE_LORA_KERNEL`` picks one
    explicitly (benchmarks, bisecting, and ``triton`` under Triton's CPU interpreter)."""
    choice = os.environ.get(_ENV, "").strip().lower()
    if choice:
        if choice not in KERNELS:
            raise ValueError(f"{_ENV} must be one of {', '.join(KERNELS)}, got {choice!r}")
        return choice
    if device.type == "cpu":
        return "grouped"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "dense"


@dataclass(slots=True)
class LoRAMapping:
    """Which batch rows use which slot, for one step: built once, read by every layer."""

    rows: Tensor  # [n] int64: the rows that use an adapter, grouped by slot (ascending)
    offs: Tensor  # [slots] int32: where each slot's group ends in ``rows`` (grouped_mm's)
    row_slots: Tensor  # [n] int64: the slot of each of those rows (the dense kernel's)
    kernel: str  # "grouped", "padded" or "dense"
    # "padded": slots lo..hi-1 as a batch of ``width`` rows each (a slot's rows, then row
    # 0 as padding, its products zeroed by ``pad_valid``)
    slot_lo: int = 0
    slot_hi: int = 0
    pad_rows: Tensor | None = None  # [(hi - lo) * width] int64
    pad_valid: Tensor | None = None  # [hi - lo, width, 1], 1 for a real row, 0 for padding
    # "triton": tiles of rows that never cross a slot (kernels/lora_triton.py), int32
    tile_start: Tensor | None = None
    tile_end: Tensor | None = None
    tile_slot: Tensor | None = None

    @classmethod
    def build(
        cls,
        spans: Sequence[tuple[int, int, int]],
        num_slots: int,
        device: torch.device,
        kernel: str = "grouped",
        dtype: torch.dtype = torch.float32,
    ) -> LoRAMapping | None:
        """``spans``: (slot, first row, row count) of each request that uses an adapter;
        None when there is none. ``grouped`` becomes ``padded`` where the slots in use hold
        about as many rows each (a decode batch spread over its adapters): one batched GEMM
        over slots of equal height costs less than grouped_mm's GEMM per slot, and the
        padding it computes is bounded here."""
        by_slot: list[list[int]] = [[] for _ in range(num_slots)]
        for slot, start, count in spans:
            by_slot[slot].extend(range(start, start + count))
        rows: list[int] = []
        ends: list[int] = []
        slots: list[int] = []
        for s, group in enumerate(by_slot):
            rows.extend(group)
            slots.extend([s] * len(group))
            ends.append(len(rows))
        if not rows:
            return None
        m = cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            offs=torch.tensor(ends, dtype=torch.int32, device=device),
            row_slots=torch.tensor(slots, dtype=torch.int64, device=device),
            kernel=kernel,
        )
        if kernel == "triton":
            from kvroute.kernels.lora_triton import tiles

            groups = [(s, ends[s] - len(g), len(g)) for s, g in enumerate(by_slot) if g]
            starts, stops, owners = tiles(groups)
            m.tile_start, m.tile_end, m.tile_slot = (
                torch.tensor(v, dtype=torch.int32, device=device) for v in (starts, stops, owners)
            )
            return m
        used = [s for s, group in enumerate(by_slot) if group]
        lo, hi = used[0], used[-1] + 1
        width = max(len(g) for g in by_slot)
        if kernel == "grouped" and (hi - lo) * width * 2 <= len(rows) * 3:  # <= 1.5x
            pad, valid = [], []
            for group in by_slot[lo:hi]:
                pad.extend(group + [0] * (width - len(group)))
                valid.extend([1.0] * len(group) + [0.0] * (width - len(group)))
            m.kernel, m.slot_lo, m.slot_hi = "padded", lo, hi
            m.pad_rows = torch.tensor(pad, dtype=torch.int64, device=device)
            m.pad_valid = torch.tensor(valid, dtype=dtype, device=device).view(hi - lo, width, 1)
        return m


def add_lora(y: Tensor, x: Tensor, a: Tensor, bs: Sequence[Tensor], m: LoRAMapping) -> None:
    """``y[rows] += [x @ A_t @ B_t for each target t, side by side]`` per row's slot, in
    place. ``x``: [tokens, in]; ``y``: [tokens, sum of out_t] (the fused projection's output)."""
    if m.kernel == "triton":
        from kvroute.kernels import lora_triton

        assert m.tile_start is not None and m.tile_end is not None and m.tile_slot is not None
        lora_triton.add_lora(y, x, a, bs, m.rows, m.tile_start, m.tile_end, m.tile_slot)
        return
    rank = bs[0].shape[1]
    if m.kernel == "padded":
        assert m.pad_rows is not None and m.pad_valid is not None
        lo, hi = m.slot_lo, m.slot_hi
        xs = x.index_select(0, m.pad_rows).view(hi - lo, -1, x.shape[1])
        u = torch.bmm(xs, a[lo:hi])
        u.mul_(m.pad_valid)  # padding rows add zeros (to row 0)
        parts = [torch.bmm(u[..., i * rank : (i + 1) * rank], b[lo:hi]) for i, b in enumerate(bs)]
        d = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        y.index_add_(0, m.pad_rows, d.view(m.pad_rows.shape[0], -1))
        return
    xs = x.index_select(0, m.rows)
    if m.kernel == "grouped":
        u = F.grouped_mm(xs, a, offs=m.offs)
        parts = [
            F.grouped_mm(u[:, i * rank : (i + 1) * rank], b, offs=m.offs) for i, b in enumerate(bs)
        ]
    else:
        n = xs.shape[0]
        pick = (m.row_slots, torch.arange(n, device=xs.device))
        u = torch.matmul(xs, a)[pick]  # [slots, n, R] -> each row's own slot: [n, R]
        parts = [torch.matmul(u[:, i * rank : (i + 1) * rank], b)[pick] for i, b in enumerate(bs)]
    y.index_add_(0, m.rows, parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
