"""Cascade decode (a shared prefix attended once) against an independent dense oracle.

Sequences that share their first blocks by block id are what the engine produces after a
prefix-cache hit; the reference kernel then attends the shared prefix once for all of them.
The oracle never sees block tables: it reads each sequence's K/V as one contiguous tensor.
"""

from __future__ import annotations

import pytest
import torch

from kvroute.kernels import AttentionMetadata, paged_attention
from kvroute.kernels import reference as ref


def _shared_prefix_batch(
    prefix_len: int,
    tails: list[int],
    loners: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    block_size: int = 16,
    head_dim: int = 16,
    seed: int = 0,
):
    """Decodes sharing ``prefix_len`` tokens (block-aligned), plus unrelated decodes."""
    g = torch.Generator().manual_seed(seed)
    assert prefix_len % block_size == 0
    lens = [prefix_len + t for t in tails] + loners
    n_prefix = prefix_len // block_size
    own = [-(-t // block_size) for t in tails] + [-(-n // block_size) for n in loners]
    num_blocks = n_prefix + sum(own) + 4
    perm = torch.randperm(num_blocks, generator=g).tolist()
    prefix_blocks, used = perm[:n_prefix], n_prefix
    tables = []
    for i in range(len(lens)):
        mine = perm[used : used + own[i]]
        used += own[i]
        tables.append((prefix_blocks if i < len(tails) else []) + mine)
    width = max(len(t) for t in tables) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    pk = torch.randn(prefix_len, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    pv = torch.randn(prefix_len, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    keys, values = [], []
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        k = torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
        if i < len(tails):
            k[:prefix_len], v[:prefix_len] = pk, pv
        for p in range(n):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    padded = [t + [10**6] * (width - len(t)) for t in tables]  # garbage past each table
    query = torch.randn(len(lens), num_heads, head_dim, generator=g, dtype=torch.float64)
    meta = AttentionMetadata.of(
        torch.tensor(padded, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.arange(len(lens) + 1, dtype=torch.int32),
    )
    return query, k_cache, v_cache, meta, head_dim**-0.5, keys, values


def _oracle(query, keys, values, scale):
    out = torch.empty_like(query)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        group = query.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[i], kk) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), vv)
    return out


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("tails", [[1, 5, 16, 17, 40, 3], [1, 1, 1, 1], [33] * 9])
def test_cascade_matches_dense(group: int, tails: list[int]) -> None:
    query, kc, vc, meta, scale, keys, values = _shared_prefix_batch(
        512, tails, loners=[20, 700], num_heads=2 * group, num_kv_heads=2
    )
    groups, rest = ref._cascade_groups(
        list(range(len(tails) + 2)), meta.block_tables, meta.seq_lens.tolist(), 16
    )
    assert [sorted(m) for m, _ in groups] == [list(range(len(tails)))]  # the path under test ran
    assert groups[0][1] == 32  # all 512 prefix tokens: every tail is at least one token
    assert sorted(rest) == [len(tails), len(tails) + 1]
    out = paged_attention(query, kc, vc, meta, scale=scale)
    torch.testing.assert_close(out, _oracle(query, keys, values, scale), atol=1e-10, rtol=1e-10)


def test_cascade_stops_at_the_first_differing_block_and_keeps_a_tail() -> None:
    """A member whose context ends exactly on a shared block boundary keeps its last block."""
    query, kc, vc, meta, scale, keys, values = _shared_prefix_batch(
        320, [16, 16, 16, 16, 48], loners=[], num_heads=4, num_kv_heads=2
    )
    lens = meta.seq_lens.tolist()
    groups, _ = ref._cascade_groups(list(range(5)), meta.block_tables, lens, 16)
    members, shared = groups[0]
    assert shared == 20  # 320 tokens; every member still has >= 1 own token after it
    assert all(lens[i] > shared * 16 for i in members)
    out = paged_attention(query, kc, vc, meta, scale=scale)
    torch.testing.assert_close(out, _oracle(query, keys, values, scale), atol=1e-10, rtol=1e-10)


def test_small_groups_and_short_prefixes_take_the_plain_path() -> None:
    query, kc, vc, meta, scale, keys, values = _shared_prefix_batch(
        64, [4, 4, 4, 4, 4], loners=[], num_heads=4, num_kv_heads=2
    )
    groups, rest = ref._cascade_groups(
        list(range(5)), meta.block_tables, meta.seq_lens.tolist(), 16
    )
    assert groups == [] and rest == list(range(5))
    out = paged_attention(query, kc, vc, meta, scale=scale)
    torch.testing.assert_close(out, _oracle(query, keys, values, scale), atol=1e-10, rtol=1e-10)
