"""Random paged batches and an independent dense oracle for the kernel tests.

Each sequence's full K/V is drawn as one contiguous tensor (the truth); the paged cache is
then filled through a shuffled block table, and the oracle reads only the contiguous
tensors, so a wrong gather, slot or mask in the kernels cannot cancel out in the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvroute.kernels import AttentionMetadata


@dataclass
class Batch:
    query: Tensor  # [num_tokens (+ padding rows), H, D]
    keys: list[Tensor]  # per sequence, [seq_len, Hk, D]: the truth
    values: list[Tensor]
    new_keys: Tensor  # [num_tokens, Hk, D]: the new tokens' K/V, in query order
    new_values: Tensor
    k_cache: Tensor  # prefix already written, new tokens not yet
    v_cache: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    slot_mapping: Tensor  # the new tokens' slots
    q_lens: list[int]
    scale: float

    def meta(
        self, *, max_query_len: int | None = None, max_seq_len: int | None = None
    ) -> AttentionMetadata:
        """The batch's index tensors as ``paged_attention``'s metadata (maxima: none given)."""
        return AttentionMetadata.of(
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            slot_mapping=self.slot_mapping,
        )

    def inputs(
        self, *, max_query_len: int | None = None, max_seq_len: int | None = None
    ) -> tuple[Tensor, Tensor, Tensor, AttentionMetadata]:
        """``paged_attention``'s positional arguments: query, caches and :meth:`meta`."""
        meta = self.meta(max_query_len=max_query_len, max_seq_len=max_seq_len)
        return self.query, self.k_cache, self.v_cache, meta


def make_batch(
    specs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    padding_rows: int = 0,
    seed: int = 0,
) -> Batch:
    """specs: (cached_len, q_len) per sequence. The cache starts as NaN (stale garbage)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    q_lens = [q for _, q in specs]
    nblocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblocks) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()  # shuffled, non-contiguous blocks
    width = max(nblocks, default=0) + 2
    tables, used = [], 0
    for n in nblocks:
        # Padding past a sequence's blocks is garbage on purpose: -1 and far out of range.
        pad = [-1 if j % 2 else 10**6 for j in range(width - n)]
        tables.append(perm[used : used + n] + pad)
        used += n

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    keys = [rand(s, num_kv_heads, head_dim) for s in seq_lens]
    values = [rand(s, num_kv_heads, head_dim) for s in seq_lens]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots, new_k, new_v = [], [], []
    for table, (cached, q), k, v in zip(tables, specs, keys, values, strict=True):
        for p in range(cached + q):
            blk, off = table[p // block_size], p % block_size
            if p < cached:  # the cached prefix, written directly (not through store_kv)
                k_cache[blk, off], v_cache[blk, off] = k[p], v[p]
            else:
                slots.append(blk * block_size + off)
        new_k.append(k[cached:])
        new_v.append(v[cached:])
    num_tokens = sum(q_lens)
    query = rand(num_tokens + padding_rows, num_heads, head_dim)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)

    def dev(t: Tensor) -> Tensor:
        return t.to(device)

    return Batch(
        query=dev(query),
        keys=keys,
        values=values,
        new_keys=dev(torch.cat(new_k) if new_k else rand(0, num_kv_heads, head_dim)),
        new_values=dev(torch.cat(new_v) if new_v else rand(0, num_kv_heads, head_dim)),
        k_cache=dev(k_cache),
        v_cache=dev(v_cache),
        block_tables=dev(torch.tensor(tables, dtype=torch.int32).view(len(specs), width)),
        seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
        query_start_loc=dev(torch.tensor(starts, dtype=torch.int32)),
        slot_mapping=dev(torch.tensor(slots, dtype=torch.int64)),
        q_lens=q_lens,
        scale=head_dim**-0.5,
    )


def dense_attention(batch: Batch, window: int | None = None) -> Tensor:
    """Naive float64 attention from the contiguous per-sequence K/V, explicit causal mask
    (and, with ``window``, the sliding window's: a query at p sees p - window + 1 .. p)."""
    query = batch.query.detach().cpu().double()
    out = torch.zeros_like(query)
    start = 0
    for k, v, q_len in zip(batch.keys, batch.values, batch.q_lens, strict=True):
        seq_len = k.shape[0]
        group = query.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [S, H, D]; head h reads kv head h//G
        vv = v.double().repeat_interleave(group, dim=1)
        q = query[start : start + q_len]
        scores = torch.einsum("qhd,khd->hqk", q, kk) * batch.scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        allowed = torch.arange(seq_len)[None, :] <= q_pos
        if window is not None:
            allowed &= torch.arange(seq_len)[None, :] > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
        start += q_len
    return out


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float64:
        return {"atol": 1e-10, "rtol": 1e-10}
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    return {"atol": 2e-2, "rtol": 2e-2}  # bf16/fp16 output rounding dominates


# Named scenarios: (cached_len, q_len) per sequence.
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "prefill": [(0, 37), (0, 1 + 16), (0, 64), (0, 2)],
    "prefix": [(16, 21), (45, 3), (100, 40), (31, 2)],
    "decode": [(0, 1), (15, 1), (16, 1), (70, 1), (130, 1), (700, 1)],
    "mixed": [(40, 1), (0, 23), (33, 1), (64, 17), (5, 1), (0, 1), (200, 9)],
}
