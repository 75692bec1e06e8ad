"""Plain-torch paged KV store and paged attention: the definition of truth, and the CPU path.

The CPU engine runs this for real, so it is shaped for speed as well as clarity:

* a sequence with new tokens is attended with one SDPA call over its gathered blocks; a fresh
  prefill (``q_len == seq_len``) uses ``is_causal=True`` (top-left and bottom-right alignment
  coincide there, and it takes torch's fused CPU flash kernel), a chunk over a cached prefix
  passes an explicit bottom-right mask, because ``is_causal`` aligns top-left; a lone decode
  needs no mask and runs its GQA group as the query length (no KV head expansion);
* several decodes (``q_len == 1``) are sorted by length and cut into chunks whose gathered
  K/V stay within a few MiB, each chunk one padded SDPA call. Small chunks matter on CPU:
  a fresh tens-of-MiB temporary costs more in page faults than the attention itself, while
  allocations of a few MiB are recycled by the allocator.

Cache slots that were never written may hold anything (``torch.empty`` garbage, even NaN), so
no value from a position at or beyond a sequence's length may reach the output, not even
multiplied by a zero probability.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention as sdpa

from kvroute.kernels.metadata import AttentionMetadata

__all__ = ["attend_decodes", "attend_prefills", "check_batch", "paged_attention", "store_kv"]

# Bytes of gathered K (and again of V) per decode chunk: big enough to batch dozens of short
# sequences, small enough to be recycled by malloc rather than page-faulted in every call.
_DECODE_CHUNK_BYTES = 4 << 20

# SDPA's enable_gqa (torch >= 2.5) reads each KV head once instead of a repeated copy.
_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _flat_slots(cache: Tensor) -> Tensor | None:
    """[num_blocks * block_size, H, D] view of a cache, or None if its strides forbid one."""
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError:
        return None


def store_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write each token's K/V into its cache slot; negative slots are padding and skipped.

    ``key``/``value`` may hold more rows than ``slot_mapping`` (a padded batch): only the
    first ``len(slot_mapping)`` rows are stored.
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if key.shape[0] < n or value.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} slots but key/value have {key.shape[0]} rows")
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    key, value = key[:n], value[:n]
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    block_size = k_cache.shape[1]
    for src, cache in ((key, k_cache), (value, v_cache)):
        src = src.to(cache.dtype)
        flat = _flat_slots(cache)
        if flat is not None:
            flat.index_copy_(0, slots, src)
        else:  # a strided cache (e.g. one half of a fused KV tensor): index by (block, offset)
            cache[slots // block_size, slots % block_size] = src


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 accumulate in fp32; fp32 and fp64 stay as they are (tests use fp64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _gather_seq(cache: Tensor, blocks: Tensor, seq_len: int, dtype: torch.dtype) -> Tensor:
    """One sequence's first ``seq_len`` cache positions as a [1, num_kv_heads, seq_len, D] view."""
    g = cache.index_select(0, blocks)  # [nb, bs, Hk, D], a fresh copy
    g = g.view(-1, *cache.shape[2:])[:seq_len]
    return g.to(dtype).transpose(0, 1)[None]


def _attend_one(
    out: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    blocks: Tensor,
    start: int,
    q_len: int,
    seq_len: int,
    scale: float,
    cdt: torch.dtype,
) -> None:
    """One sequence through SDPA, bottom-right causal. Inputs are 4-D on purpose: torch's
    CPU flash kernel takes only those (3-D falls back to the math path, ~15x slower at 2k)."""
    num_heads, num_kv_heads, head_dim = query.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    k = _gather_seq(k_cache, blocks, seq_len, cdt)
    v = _gather_seq(v_cache, blocks, seq_len, cdt)
    q = query[start : start + q_len].to(cdt)
    if q_len == 1:  # sees every key: the GQA group stands in for the query length, no mask
        o = sdpa(q.view(1, num_kv_heads, group, head_dim), k, v, scale=scale)
        out[start] = o.reshape(num_heads, head_dim).to(out.dtype)
        return
    gqa: dict[str, bool] = {}
    if group > 1 and _HAS_ENABLE_GQA:
        gqa["enable_gqa"] = True
    elif group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q = q.transpose(0, 1)[None]  # [1, H, q_len, D]
    if q_len == seq_len:
        o = sdpa(q, k, v, is_causal=True, scale=scale, **gqa)
    else:
        # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
        key_pos = torch.arange(seq_len, device=query.device)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = key_pos[None, :] <= q_pos[:, None]
        o = sdpa(q, k, v, attn_mask=mask, scale=scale, **gqa)
    out[start : start + q_len] = o[0].transpose(0, 1).to(out.dtype)


def _decode_chunks(seqs: list[int], seq_lens: list[int], per_token: int) -> list[list[int]]:
    """Decode sequences sorted by length, cut so that each chunk's padded K stays within
    ``_DECODE_CHUNK_BYTES`` (``per_token`` bytes per cached token); a longer one stands alone.
    """
    chunks: list[list[int]] = []
    for i in sorted(seqs, key=lambda i: seq_lens[i]):
        # Sorted ascending, so i is the longest in the chunk it would join.
        if chunks and (len(chunks[-1]) + 1) * seq_lens[i] * per_token <= _DECODE_CHUNK_BYTES:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def _gather_padded(
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seqs: list[int],
    first_block: int,
    lengths: list[int],
    cdt: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """K/V of ``lengths[j]`` positions of sequence ``seqs[j]`` from block ``first_block`` on,
    as [n, L, Hk, D] padded to the longest, and the [n, L] mask of real positions."""
    device = k_cache.device
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    n = len(seqs)
    lens = torch.tensor(lengths, device=device)
    nb = -(-max(lengths) // block_size)
    idx = torch.tensor(seqs, device=device)
    bt = block_tables.index_select(0, idx)[:, first_block : first_block + nb].long()
    # Entries past a sequence's blocks are arbitrary (maybe out of range): point them at block 0.
    n_blocks = (lens + block_size - 1) // block_size
    bt = bt.masked_fill(torch.arange(nb, device=device)[None, :] >= n_blocks[:, None], 0)
    length = nb * block_size
    keep = torch.arange(length, device=device)[None, :] < lens[:, None]  # [n, L]
    flat = bt.flatten()
    k = k_cache.index_select(0, flat).view(n, length, num_kv_heads, head_dim).to(cdt)
    v = v_cache.index_select(0, flat).view(n, length, num_kv_heads, head_dim).to(cdt)
    # Unwritten slots may hold NaN: zero them in both, as SDPA masks by adding -inf (NaN
    # stays NaN) and 0 * NaN would survive a zero probability. Only the padded rows are
    # touched (a full masked_fill costs as much as the attention).
    pad_rows = (~keep).flatten().nonzero().squeeze(1)
    if pad_rows.numel():
        k.view(n * length, num_kv_heads, head_dim).index_fill_(0, pad_rows, 0.0)
        v.view(n * length, num_kv_heads, head_dim).index_fill_(0, pad_rows, 0.0)
    return k, v, keep


def _decode_chunk(
    out: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seqs: list[int],
    starts: list[int],
    seq_lens: list[int],
    scale: float,
    cdt: torch.dtype,
) -> None:
    """Several q_len == 1 sequences, padded to the chunk's longest, in one SDPA call."""
    device = query.device
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    n = len(seqs)
    # [n, L, Hk, D] copies, read through [n, Hk, L, D] views: SDPA takes the strides as they are.
    k, v, keep = _gather_padded(
        k_cache, v_cache, block_tables, seqs, 0, [seq_lens[i] for i in seqs], cdt
    )
    rows = torch.tensor([starts[i] for i in seqs], device=device)
    q = query.index_select(0, rows).to(cdt).view(n, num_kv_heads, group, head_dim)
    o = sdpa(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None, :], scale=scale
    )  # [n, Hk, G, D]: the GQA group as the query length again
    out.index_copy_(0, rows, o.reshape(n, num_heads, head_dim).to(out.dtype))


# Decodes whose block tables begin with the same blocks (siblings of one cached prefix)
# attend to that shared prefix once, as one matmul for all of them, and to their own tails
# separately; the two partial softmaxes merge by log-sum-exp (cascade attention, as vLLM
# and FlashInfer do for shared prefixes). Below these sizes the split does not pay.
_CASCADE_MIN_SEQS = 4
_CASCADE_MIN_TOKENS = 256


def _cascade_groups(
    decodes: list[int], block_tables: Tensor, seq_lens: list[int], block_size: int
) -> tuple[list[tuple[list[int], int]], list[int]]:
    """(members, shared full blocks) per cascade group, and the decodes left over.

    Members share block ids (physically the same KV), and only blocks every member has
    filled and moved past count, so each member keeps at least one token of its own tail.
    """
    by_first: dict[int, list[int]] = {}
    for i in decodes:
        if seq_lens[i] > _CASCADE_MIN_TOKENS:
            by_first.setdefault(int(block_tables[i, 0]), []).append(i)
    groups: list[tuple[list[int], int]] = []
    grouped: set[int] = set()
    for members in by_first.values():
        if len(members) < _CASCADE_MIN_SEQS:
            continue
        limit = min((seq_lens[i] - 1) // block_size for i in members)
        rows = block_tables[members, :limit]
        same = (rows == rows[0]).all(dim=0)
        shared = int(same.long().cumprod(0).sum()) if limit else 0
        if shared * block_size >= _CASCADE_MIN_TOKENS:
            groups.append((members, shared))
            grouped.update(members)
    return groups, [i for i in decodes if i not in grouped]


def _partial(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, scale: float):
    """Softmax attention over one key range: (normalized output, log-sum-exp per row)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v), lse


def _decode_cascade(
    out: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seqs: list[int],
    shared_blocks: int,
    starts: list[int],
    seq_lens: list[int],
    scale: float,
    cdt: torch.dtype,
) -> None:
    """Decodes sharing their first ``shared_blocks`` blocks: the prefix once, tails apart."""
    device = query.device
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    n = len(seqs)
    rows = torch.tensor([starts[i] for i in seqs], device=device)
    q = query.index_select(0, rows).to(cdt).view(n, num_kv_heads, group, head_dim)
    # Shared prefix: [Hk, n*G, D] against [Hk, Ls, D], one gather, one pair of matmuls.
    prefix = block_tables[seqs[0], :shared_blocks].long()
    ks = _gather_seq(k_cache, prefix, shared_blocks * block_size, cdt)  # [Hk, Ls, D]
    vs = _gather_seq(v_cache, prefix, shared_blocks * block_size, cdt)
    qs = q.permute(1, 0, 2, 3).reshape(num_kv_heads, n * group, head_dim)
    o1, lse1 = _partial(qs, ks, vs, None, scale)
    o1 = o1.view(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3)
    lse1 = lse1.view(num_kv_heads, n, group, 1).permute(1, 0, 2, 3)
    # Tails: each sequence's own blocks after the prefix, padded to the longest.
    tails = [seq_lens[i] - shared_blocks * block_size for i in seqs]
    k, v, keep = _gather_padded(k_cache, v_cache, block_tables, seqs, shared_blocks, tails, cdt)
    o2, lse2 = _partial(q, k.transpose(1, 2), v.transpose(1, 2), keep[:, None, None, :], scale)
    lse = torch.logaddexp(lse1, lse2)
    o = o1 * torch.exp(lse1 - lse) + o2 * torch.exp(lse2 - lse)
    out.index_copy_(0, rows, o.reshape(n, num_heads, head_dim).to(out.dtype))


def check_batch(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    sliding_window: int | None,
) -> tuple[list[int], list[int]]:
    """Validates a batch; returns (query_start_loc, seq_lens) as host lists."""
    block_tables = meta.block_tables
    max_query_len, max_seq_len = meta.max_query_len, meta.max_seq_len
    if query.dim() != 3 or k_cache.dim() != 4:
        raise ValueError("query must be [T, H, D] and caches [num_blocks, block_size, Hk, D]")
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.shape[2] != k_cache.shape[3] or k_cache.shape != v_cache.shape:
        raise ValueError("query, k_cache and v_cache disagree on head_dim or shape")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, not {sliding_window}")
    qsl = meta.query_start_loc.tolist()
    lens = meta.seq_lens.tolist()
    num_seqs = len(lens)
    if len(qsl) != num_seqs + 1 or qsl[0] != 0 or qsl[-1] > query.shape[0]:
        raise ValueError("query_start_loc must be [num_seqs + 1], start at 0, end <= num_tokens")
    block_size = k_cache.shape[1]
    q_lens = [qsl[i + 1] - qsl[i] for i in range(num_seqs)]
    for i, (q_len, seq_len) in enumerate(zip(q_lens, lens, strict=True)):
        if q_len < 0 or q_len > seq_len:
            raise ValueError(f"sequence {i}: {q_len} new tokens but seq_len {seq_len}")
        if seq_len > block_tables.shape[1] * block_size:
            raise ValueError(f"sequence {i}: seq_len {seq_len} exceeds its block table")
    if max_query_len is not None and max_query_len < max(q_lens, default=0):
        raise ValueError(f"max_query_len {max_query_len} < actual {max(q_lens)}")
    if max_seq_len is not None and max_seq_len < max(lens, default=0):
        raise ValueError(f"max_seq_len {max_seq_len} < actual {max(lens)}")
    return qsl, lens


def _windowed(
    out: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    table: Tensor,
    start: int,
    q_len: int,
    seq_len: int,
    window: int,
    scale: float,
    cdt: torch.dtype,
) -> None:
    """One sequence under a sliding window: query at position p sees keys p-window+1 .. p.

    Only the blocks from the first key the first query can see are gathered; the mask is
    explicit (both edges), so this path is slow and plain on purpose: the definition."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    lo = max(0, seq_len - q_len - window + 1)
    first = lo // block_size
    blocks = table[first : -(-seq_len // block_size)].long()
    k = _gather_seq(k_cache, blocks, seq_len - first * block_size, cdt)
    v = _gather_seq(v_cache, blocks, seq_len - first * block_size, cdt)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    key_pos = torch.arange(first * block_size, seq_len, device=query.device)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    mask = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] > q_pos[:, None] - window)
    q = query[start : start + q_len].to(cdt).transpose(0, 1)[None]
    o = sdpa(q, k, v, attn_mask=mask, scale=scale)
    out[start : start + q_len] = o[0].transpose(0, 1).to(out.dtype)


def window_applies(seq_len: int, window: int | None) -> bool:
    """Whether some query of this sequence is denied a key by the window (the last one sees
    the most keys: all ``seq_len`` of them without a window)."""
    return window is not None and seq_len > window


def attend_prefills(
    out: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    qsl: list[int],
    lens: list[int],
    scale: float,
    sliding_window: int | None,
    seqs: list[int] | None = None,
) -> list[int]:
    """Attends every sequence (of ``seqs``, default all) with more than one new token, and
    every one the window cuts, decodes included; returns the decodes left for
    :func:`attend_decodes`."""
    block_size = k_cache.shape[1]
    cdt = _compute_dtype(query.dtype)
    decodes: list[int] = []
    for i in range(len(lens)) if seqs is None else seqs:
        q_len, seq_len = qsl[i + 1] - qsl[i], lens[i]
        if window_applies(seq_len, sliding_window):
            assert sliding_window is not None
            table = block_tables[i]
            _windowed(
                out,
                query,
                k_cache,
                v_cache,
                table,
                qsl[i],
                q_len,
                seq_len,
                sliding_window,
                scale,
                cdt,
            )
        elif q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            blocks = block_tables[i, : -(-seq_len // block_size)].long()
            _attend_one(out, query, k_cache, v_cache, blocks, qsl[i], q_len, seq_len, scale, cdt)
    return decodes


def attend_decodes(
    out: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    decodes: list[int],
    qsl: list[int],
    lens: list[int],
    scale: float,
) -> None:
    """Sequences with one new token that see their whole context: cascades over shared
    prefixes, then padded chunks."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cdt = _compute_dtype(query.dtype)
    groups, decodes = _cascade_groups(decodes, block_tables, lens, block_size)
    for members, shared in groups:
        _decode_cascade(
            out, query, k_cache, v_cache, block_tables, members, shared, qsl, lens, scale, cdt
        )
    per_token = num_kv_heads * k_cache.shape[3] * torch.finfo(cdt).bits // 8
    for chunk in _decode_chunks(decodes, lens, per_token):
        if len(chunk) == 1:
            i = chunk[0]
            blocks = block_tables[i, : -(-lens[i] // block_size)].long()
            _attend_one(out, query, k_cache, v_cache, blocks, qsl[i], 1, lens[i], scale, cdt)
        else:
            _decode_chunk(out, query, k_cache, v_cache, block_tables, chunk, qsl, lens, scale, cdt)


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Causal (bottom-right) attention of a varlen batch of new tokens over the paged cache.

    ``meta`` gives the step's index tensors (its ``slot_mapping`` and ``num_decodes`` are
    not read). ``sliding_window``: a query at position p sees keys p - sliding_window + 1 ..
    p only (transformers' and vLLM's convention); None sees all. The maxima in ``meta`` are
    accepted for parity with the Triton path (which sizes its tiles from ``max_query_len``);
    here they are only checked, so a runner that passes maxima below the real ones fails on
    CPU, in tests, rather than silently on a GPU.
    """
    qsl, lens = check_batch(query, k_cache, v_cache, meta, sliding_window)
    block_tables = meta.block_tables
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    out[qsl[-1] :].zero_()  # rows past the last sequence are padding
    decodes = attend_prefills(
        out, query, k_cache, v_cache, block_tables, qsl, lens, scale, sliding_window
    )
    attend_decodes(out, query, k_cache, v_cache, block_tables, decodes, qsl, lens, scale)
    return out
