"""Triton store_kv and paged attention for CUDA, with the reference's exact signatures.

Imported only by ``kvroute.kernels`` when CUDA is available (and by GPU tests), never at
package import: Triton may fail to import on a machine without a GPU. No autotuning, for the
same reason and so that the first step of a replica does not stall on a tuning sweep.

Paged attention design (one kernel for prefills, chunks and decodes mixed in one batch):

* a program owns one KV head and a tile of ``BLOCK_Q`` consecutive query tokens of one
  sequence; its ``BLOCK_M = BLOCK_Q * GROUP`` rows are those tokens times the ``GROUP``
  query heads that share the KV head, so each K/V tile is loaded once for the whole group;
* the grid is sized from host-known numbers only (``num_tokens // BLOCK_Q + num_seqs`` tiles
  is enough for any split of the tokens), and each program finds its sequence by binary
  search over ``query_start_loc``; surplus programs exit at once. No device sync;
* it walks the sequence's keys ``TILE_N`` at a time up to the last position its rows may see,
  looking up each key's physical block in the block table (so any cache block size works,
  1 included, independent of the tile), with an online softmax in fp32 (exp2 domain);
* keys at or past ``seq_len`` are never loaded, so stale garbage in the cache cannot leak.
"""

# Triton's convention: compile-time (tl.constexpr) parameters are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvroute.kernels.metadata import AttentionMetadata

__all__ = ["paged_attention", "store_kv"]

_LOG2E = 1.4426950408889634
# "No window" as a window wider than any sequence: one code path, no branch in the kernel.
_NO_WINDOW = 1 << 30


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_dim] K and V into its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d * stride_kcd
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with query_start_loc[i] // BLOCK_Q + i <= tile (sequence i's first tile)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_seqs,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)  # this program's tile within the sequence
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached tokens before this step's first new one

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DIM_PAD)
    q_tok = local * BLOCK_Q + offs_m // GROUP  # row -> token within the sequence
    q_head = kv_head * GROUP + offs_m % GROUP  # row -> query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    d_ok = offs_d < HEAD_DIM
    q_row = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr
        + q_row[:, None] * stride_qt
        + q_head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = ctx_len + q_tok  # absolute position: sees keys 0..q_pos (bottom-right causal)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)

    # The tile's last valid row sees the most keys; nothing past it is loaded. Under a
    # sliding window (a query at p sees p - window + 1 .. p) the tile's first row sees the
    # earliest key: the walk starts at that key's tile.
    num_keys = ctx_len + tl.minimum((local + 1) * BLOCK_Q, q_len)
    first_key = tl.maximum(ctx_len + local * BLOCK_Q - window + 1, 0)
    offs_n = tl.arange(0, TILE_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_off_h_k = kv_head * stride_kh
    kv_off_h_v = kv_head * stride_vh
    for start in range((first_key // TILE_N) * TILE_N, num_keys, TILE_N):
        pos = start + offs_n
        key_ok = pos < num_keys
        blk = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        off = (pos % BLOCK_SIZE).to(tl.int64)
        k_rows = blk * stride_kb + off * stride_ks + kv_off_h_k
        v_rows = blk * stride_vb + off * stride_vs + kv_off_h_v
        k = tl.load(  # [DIM_PAD, TILE_N], K transposed
            k_cache_ptr + k_rows[None, :] + offs_d[:, None] * stride_kd,
            mask=key_ok[None, :] & d_ok[:, None],
            other=0.0,
        ).to(q.dtype)
        s = tl.dot(q, k, input_precision="ieee") if IEEE else tl.dot(q, k)
        s = s * scale_log2
        visible = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that saw nothing yet
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(  # [TILE_N, DIM_PAD]
            v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd,
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(q.dtype)
        p = p.to(v.dtype)
        pv = tl.dot(p, v, input_precision="ieee") if IEEE else tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr
        + q_row[:, None] * stride_ot
        + q_head[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def store_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Same contract as ``kvroute.kernels.reference.store_kv``."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if key.shape[0] < n or value.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} slots but key/value have {key.shape[0]} rows")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _store_kv_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


def launch_config(
    num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int | None
) -> dict[str, int]:
    """Tile sizes, chosen from host-known numbers only (no device sync).

    A decode-only step (``max_query_len == 1``) gets the smallest row tile ``tl.dot``
    accepts (16); anything else (or unknown) gets 64 rows. Pure function, so it is tested
    without a GPU.
    """
    group = num_heads // num_kv_heads
    rows = 16 if max_query_len is not None and max_query_len * group <= 16 else 64
    block_m = max(rows, triton.next_power_of_2(group))
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    return {
        "GROUP": group,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "DIM_PAD": dim_pad,
        "TILE_N": 64 if dim_pad <= 64 else 32,
    }


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Same contract as ``kvroute.kernels.reference.paged_attention``; never syncs.

    ``meta.max_query_len`` only picks the tile size (results are right whatever it says; 1
    for a decode-only step gets the small tile); ``meta.max_seq_len`` is unused: each
    program reads its own sequence's length.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError("query, k_cache and v_cache disagree on head_dim or shape")
    out = torch.zeros_like(query)  # rows past the last sequence stay zero, as in the reference
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    # The kernel indexes these as dense vectors / rows (no-ops for the runner's tensors).
    block_tables, seq_lens = meta.block_tables.contiguous(), meta.seq_lens.contiguous()
    query_start_loc = meta.query_start_loc.contiguous()
    cfg = launch_config(num_heads, num_kv_heads, head_dim, meta.max_query_len)
    grid = (num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        num_seqs,
        sliding_window if sliding_window is not None else _NO_WINDOW,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        IEEE=query.dtype == torch.float32,
        num_warps=4,
        **cfg,
    )
    return out
