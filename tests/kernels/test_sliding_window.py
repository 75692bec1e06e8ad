"""Sliding-window attention in every kernel path against the dense oracle.

A window W lets a query at position p see keys p - W + 1 .. p (transformers'
``sliding_window_overlay`` and vLLM's convention). Mistral, Qwen2 (``use_sliding_window``)
and Gemma's local layers depend on it; a path that ignored it would serve those models
wrong without an error, so each case is also checked to differ from full attention.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvroute.kernels import cpu, reference

from .batches import dense_attention, make_batch, tolerance

# (cached_len, q_len): fresh prefills longer and shorter than the window, chunks over a
# cached prefix, decodes at, below and far past the window, one at the window's edge.
SPECS = [(0, 37), (0, 5), (20, 30), (100, 7), (0, 1), (6, 1), (7, 1), (300, 1), (64, 1)]
WINDOWS = [1, 8, 16, 50]


def _paths() -> list:
    paths = [pytest.param(reference.paged_attention, id="reference")]
    paths.append(
        pytest.param(
            cpu.paged_attention,
            id="cpu-c",
            marks=pytest.mark.skipif(
                not cpu.decode_kernel_available(), reason="C decode kernel not built"
            ),
        )
    )
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    paths.append(pytest.param("triton", id="triton-interpreted", marks=pytest.mark.skipif(
        not interpret, reason="needs Triton with TRITON_INTERPRET=1")))  # fmt: skip
    return paths


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (3, 4), (2, 1)])
def test_window_matches_dense(path, window: int, group: int, block_size: int) -> None:  # type: ignore[no-untyped-def]
    batch = make_batch(
        SPECS, num_heads=2 * group, num_kv_heads=2, block_size=block_size, seed=window + group
    )
    if path == "triton":
        from kvroute.kernels import triton_kernels

        store, attend = triton_kernels.store_kv, triton_kernels.paged_attention
    else:
        store, attend = reference.store_kv, path
    store(batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping)
    out = attend(*batch.inputs(), scale=batch.scale, sliding_window=window)
    want = dense_attention(batch, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, **tolerance(torch.float32))
    # The window must matter here (so a path that ignores it fails this test).
    assert not torch.allclose(want, dense_attention(batch), atol=1e-3)


def test_window_wider_than_every_sequence_is_full_attention() -> None:
    batch = make_batch(SPECS, num_heads=4, num_kv_heads=2, block_size=16, seed=3)
    reference.store_kv(
        batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping
    )
    out = cpu.paged_attention(*batch.inputs(), scale=batch.scale, sliding_window=10_000)
    torch.testing.assert_close(out.double(), dense_attention(batch), **tolerance(torch.float32))


def test_bad_window_is_refused() -> None:
    batch = make_batch([(0, 3)], num_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="sliding_window"):
        reference.paged_attention(*batch.inputs(), scale=batch.scale, sliding_window=0)
