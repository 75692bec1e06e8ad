"""The torch reference against an independent dense oracle, and store_kv against a loop."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.kernels import AttentionMetadata, available_backends, paged_attention, store_kv
from kvroute.kernels import reference as ref

from .batches import SCENARIOS, Batch, dense_attention, make_batch, tolerance


def _fill(batch: Batch) -> None:
    store_kv(batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping)


# --------------------------------------------------------------------------- store_kv


def _expected_store(cache: torch.Tensor, key: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Slot by slot, the slow and obvious way."""
    exp = cache.clone()
    bs = cache.shape[1]
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            exp[s // bs, s % bs] = key[i]
    return exp


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_and_skips_padding(block_size: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(block_size)
    num_blocks, hk, d, n = 40 // block_size + 5, 4, 32, 30
    shape = (num_blocks, block_size, hk, d)
    k_cache = torch.full(shape, 7.0, dtype=dtype)
    v_cache = torch.full(shape, -7.0, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[::4] = -1  # padding tokens
    key = torch.randn(n, hk, d, generator=g).to(dtype)
    value = torch.randn(n, hk, d, generator=g).to(dtype)
    exp_k, exp_v = _expected_store(k_cache, key, slots), _expected_store(v_cache, value, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, exp_k)
    assert torch.equal(v_cache, exp_v)
    assert (k_cache == 7.0).sum() > 0  # untouched slots stayed untouched


def test_store_kv_strided_cache_and_sources() -> None:
    """A cache that is one half of a fused [blocks, 2, ...] tensor cannot be flattened by
    view; K/V sliced out of a fused QKV projection are not contiguous."""
    g = torch.Generator().manual_seed(1)
    num_blocks, bs, hk, d, n = 6, 4, 2, 8, 10
    kv = torch.zeros(num_blocks, 2, bs, hk, d)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    qkv = torch.randn(n + 3, (2 + 2 * hk) * d, generator=g)  # 3 extra padded rows
    key = qkv[:, 2 * d : (2 + hk) * d].view(n + 3, hk, d)
    value = qkv[:, (2 + hk) * d :].view(n + 3, hk, d)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[3] = -1
    exp_k, exp_v = _expected_store(k_cache, key, slots), _expected_store(v_cache, value, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(kv[:, 0], exp_k)
    assert torch.equal(kv[:, 1], exp_v)


def test_store_kv_rejects_too_few_rows() -> None:
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError):
        store_kv(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), cache, cache.clone(), torch.arange(3))


# --------------------------------------------------------------------------- paged_attention


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("group", [1, 2, 3, 4])  # 3: SmolLM2-135M (9 heads, 3 KV heads)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_dense(scenario: str, group: int, block_size: int, dtype: torch.dtype) -> None:
    batch = make_batch(
        SCENARIOS[scenario],
        num_heads=4 * group,
        num_kv_heads=4,
        block_size=block_size,
        dtype=dtype,
        seed=group * 100 + block_size,
    )
    _fill(batch)
    out = paged_attention(*batch.inputs(), scale=batch.scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert not out.isnan().any()  # NaN garbage in unwritten slots never leaks
    torch.testing.assert_close(out.double(), dense_attention(batch), **tolerance(dtype))


def test_float64_is_exact_enough() -> None:
    """In float64 the reference must agree with the oracle to rounding, not to a tolerance."""
    batch = make_batch(SCENARIOS["mixed"], num_heads=8, num_kv_heads=2, dtype=torch.float64)
    _fill(batch)
    out = paged_attention(*batch.inputs(), scale=batch.scale)
    torch.testing.assert_close(out, dense_attention(batch), **tolerance(torch.float64))


def test_cached_prefix_is_bottom_right_aligned() -> None:
    """The pitfall: SDPA's is_causal aligns top-left; a chunk over a prefix must see it all."""
    batch = make_batch([(48, 8)], num_heads=2, num_kv_heads=2, dtype=torch.float64)
    _fill(batch)
    out = paged_attention(*batch.inputs(), scale=batch.scale)
    k, v = batch.keys[0].double(), batch.values[0].double()
    q = batch.query.double().transpose(0, 1)
    top_left = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=batch.scale
    ).transpose(0, 1)
    assert not torch.allclose(out, top_left, atol=1e-3)  # the bug would be visible...
    torch.testing.assert_close(out, dense_attention(batch))  # ...and it is not there


def test_padding_rows_are_zero_and_max_hints_checked() -> None:
    batch = make_batch([(10, 3), (4, 1)], num_heads=4, num_kv_heads=2, padding_rows=5)
    _fill(batch)
    out = paged_attention(*batch.inputs(max_query_len=3, max_seq_len=13), scale=batch.scale)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))
    torch.testing.assert_close(out[:4].double(), dense_attention(batch)[:4], **tolerance(out.dtype))
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(*batch.inputs(max_query_len=1), scale=batch.scale)


def test_rejects_inconsistent_inputs() -> None:
    batch = make_batch([(10, 3)], num_heads=4, num_kv_heads=2)
    meta = batch.meta()
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(batch.query[:, :3], batch.k_cache, batch.v_cache, meta, scale=batch.scale)
    with pytest.raises(ValueError, match="new tokens"):
        bad = replace(meta, seq_lens=torch.tensor([2], dtype=torch.int32))
        paged_attention(batch.query, batch.k_cache, batch.v_cache, bad, scale=batch.scale)
    with pytest.raises(ValueError, match="block table"):
        bad = replace(meta, seq_lens=torch.tensor([10**4], dtype=torch.int32))
        paged_attention(batch.query, batch.k_cache, batch.v_cache, bad, scale=batch.scale)


def test_decode_chunks_cover_every_sequence_once_within_budget() -> None:
    lens = [1, 5, 300, 1000, 2, 1200, 310, 40_000]
    per_token = 512
    chunks = ref._decode_chunks(list(range(len(lens))), lens, per_token)
    assert sorted(i for c in chunks for i in c) == list(range(len(lens)))
    assert len(chunks) > 1 and [7] in chunks  # a 20 MB sequence stands alone
    for c in chunks:
        assert (
            len(c) == 1 or len(c) * max(lens[i] for i in c) * per_token <= ref._DECODE_CHUNK_BYTES
        )


@pytest.mark.parametrize("budget", [1, 64 * 512, ref._DECODE_CHUNK_BYTES])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_decode_chunking_does_not_change_results(
    budget: int, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sequence alone, a few per chunk, all in one: the same answer."""
    monkeypatch.setattr(ref, "_DECODE_CHUNK_BYTES", budget)
    batch = make_batch(SCENARIOS[scenario], num_heads=8, num_kv_heads=2, dtype=torch.float64)
    _fill(batch)
    out = paged_attention(*batch.inputs(), scale=batch.scale)
    torch.testing.assert_close(out, dense_attention(batch), **tolerance(torch.float64))


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 80), st.integers(0, 20)), min_size=1, max_size=6
    ).filter(lambda s: any(q for _, q in s)),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([1, 3, 16]),
    seed=st.integers(0, 2**16),
)
def test_property_random_batches(
    specs: list[tuple[int, int]], group: int, block_size: int, seed: int
) -> None:
    """Any mix of prefill, chunk, decode and idle (q_len 0) sequences, any block size."""
    specs = [(c, q) if c + q > 0 else (c, 1) for c, q in specs]
    batch = make_batch(
        specs,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=8,
        block_size=block_size,
        seed=seed,
        dtype=torch.float64,
    )
    _fill(batch)
    out = paged_attention(*batch.inputs(), scale=batch.scale)
    torch.testing.assert_close(out, dense_attention(batch), **tolerance(torch.float64))


# --------------------------------------------------------------------------- metadata, dispatch


def test_metadata_build_matches_batch_and_drives_a_step() -> None:
    specs = [(40, 1), (0, 23), (33, 1), (64, 17)]
    batch = make_batch(specs, num_heads=4, num_kv_heads=2, block_size=16, seed=3)
    tables = [
        [b for b in row if 0 <= b < batch.k_cache.shape[0]][: -(-(c + q) // 16)]
        for row, (c, q) in zip(batch.block_tables.tolist(), specs, strict=True)
    ]
    meta = AttentionMetadata.build(
        tables, [c + q for c, q in specs], [q for _, q in specs], 16, num_padding_tokens=2
    )
    assert meta.slot_mapping[:-2].tolist() == batch.slot_mapping.tolist()
    assert meta.slot_mapping[-2:].tolist() == [-1, -1]
    assert meta.query_start_loc.tolist() == batch.query_start_loc.tolist()
    assert (meta.max_query_len, meta.max_seq_len, meta.num_decodes) == (23, 81, 1)
    assert not meta.decode_only and meta.num_seqs == 4 and meta.num_tokens == 44
    padded_k = torch.cat([batch.new_keys, torch.zeros(2, *batch.new_keys.shape[1:])])
    padded_v = torch.cat([batch.new_values, torch.zeros(2, *batch.new_values.shape[1:])])
    store_kv(padded_k, padded_v, batch.k_cache, batch.v_cache, meta.slot_mapping)
    query = torch.cat([batch.query, torch.zeros(2, *batch.query.shape[1:])])
    out = paged_attention(query, batch.k_cache, batch.v_cache, meta, scale=batch.scale)
    torch.testing.assert_close(out[:-2].double(), dense_attention(batch), **tolerance(out.dtype))


def test_metadata_rejects_overflowing_sequence() -> None:
    with pytest.raises(ValueError):
        AttentionMetadata.build([[0]], [17], [1], 16)


def test_backends_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    backends = available_backends()
    assert backends[0] == "torch"
    if not torch.cuda.is_available():
        assert backends == ["torch"]
    # CPU tensors take the reference whatever the environment asks for.
    monkeypatch.setenv("KVROUTE_KERNELS_BACKEND", "triton")
    batch = make_batch([(5, 2)], num_heads=2, num_kv_heads=1)
    _fill(batch)
    out = paged_attention(*batch.inputs(), scale=batch.scale)
    torch.testing.assert_close(out.double(), dense_attention(batch), **tolerance(out.dtype))


def test_dispatch_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA goes to Triton when it is usable, the CPU to the CPU path; the env var forces
    either side (read by select_backend, once)."""
    import types

    from kvroute.kernels import backends

    fake_triton = types.ModuleType("fake_triton")
    fake_triton.store_kv = ref.store_kv  # type: ignore[attr-defined]
    fake_triton.paged_attention = ref.paged_attention  # type: ignore[attr-defined]
    monkeypatch.setattr(backends, "_triton_module", lambda: fake_triton)
    chosen = backends.select_backend("cuda", {})
    assert isinstance(chosen, backends.TritonBackend) and chosen.module is fake_triton
    assert isinstance(backends.select_backend("cpu", {}), backends.CpuBackend)
    torch_env = {"KVROUTE_KERNELS_BACKEND": "torch"}
    assert isinstance(backends.select_backend("cuda", torch_env), backends.TorchBackend)
    assert isinstance(backends.select_backend("cpu", torch_env), backends.TorchBackend)
    monkeypatch.setattr(backends, "_triton_module", lambda: None)
    # silent fallback by default...
    assert isinstance(backends.select_backend("cuda", {}), backends.TorchBackend)
    with pytest.raises(RuntimeError, match="not usable"):  # ...an error when asked for
        backends.select_backend("cuda", {"KVROUTE_KERNELS_BACKEND": "triton"})
    # triton asked for on a CPU: the CPU path, as before
    cpu_triton = backends.select_backend("cpu", {"KVROUTE_KERNELS_BACKEND": "triton"})
    assert isinstance(cpu_triton, backends.CpuBackend)
    with pytest.raises(ValueError, match="KVROUTE_KERNELS_BACKEND"):
        backends.select_backend("cpu", {"KVROUTE_KERNELS_BACKEND": "cuda"})
