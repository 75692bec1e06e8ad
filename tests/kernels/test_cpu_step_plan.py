"""The CPU path works out a batch's plan once per step and reuses it across layers; a plan
must never outlive the tensors it was made from, nor survive their change in place."""

from __future__ import annotations

import gc

import pytest
import torch

from kvroute.kernels import AttentionMetadata, cpu, reference

from .batches import dense_attention, make_batch, tolerance

pytestmark = pytest.mark.skipif(not cpu.decode_kernel_available(), reason="C kernel not built")

SPECS = [(40, 1), (7, 1), (0, 12), (33, 1)]  # decodes and a prefill in one batch


def _run(batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    reference.store_kv(
        batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping
    )
    return cpu.paged_attention(*batch.inputs(), scale=batch.scale)


def test_layers_of_one_step_share_a_plan() -> None:
    batch = make_batch(SPECS, num_heads=6, num_kv_heads=2, seed=1)
    want = dense_attention(batch).float()
    first = _run(batch)
    plan = cpu._plans._last
    second = _run(batch)  # the next layer: same index tensors
    assert cpu._plans._last is plan
    torch.testing.assert_close(first, want, **tolerance(torch.float32))
    torch.testing.assert_close(second, want, **tolerance(torch.float32))


def test_new_tensors_at_old_addresses_get_a_new_plan() -> None:
    """Step after step the allocator hands back the same memory: identity by weak
    reference, not by address, keeps the old plan out."""
    # The second batch has the first's shapes (tokens, sequences, table width): only
    # the tensors' identity tells their plans apart.
    same_shapes = [(20, 1), (40, 1), (3, 12), (9, 1)]
    for seed, specs in enumerate([SPECS, same_shapes, [(5, 1), (60, 1), (2, 9)], SPECS]):
        batch = make_batch(specs, num_heads=6, num_kv_heads=2, seed=seed)
        torch.testing.assert_close(
            _run(batch), dense_attention(batch).float(), **tolerance(torch.float32)
        )
        del batch
        gc.collect()


@pytest.mark.parametrize("inference", [False, True])
def test_a_change_in_place_is_seen(inference: bool) -> None:
    """A runner that refills its index buffers in place (as CUDA graphs do) bumps their
    version counters, or, for inference tensors, which have none, changes their contents;
    the plan made from their old contents must not be reused."""
    with torch.inference_mode(inference):
        got, want = _change_in_place()
    torch.testing.assert_close(got, want, **tolerance(torch.float32))


def _change_in_place() -> tuple[torch.Tensor, torch.Tensor]:
    """(the CPU path's output, the oracle's) for batch b read through a's refilled tensors."""
    a = make_batch(SPECS, num_heads=6, num_kv_heads=2, seed=3)
    # Same sequence count, token count and table width as SPECS; other lengths.
    b = make_batch([(20, 1), (40, 1), (3, 12), (9, 1)], num_heads=6, num_kv_heads=2, seed=4)
    _run(a)
    for mine, theirs in ((a.block_tables, b.block_tables), (a.seq_lens, b.seq_lens)):
        assert mine.shape == theirs.shape
        mine.copy_(theirs)
    torch.testing.assert_close(a.query_start_loc, b.query_start_loc)
    reference.store_kv(b.new_keys, b.new_values, b.k_cache, b.v_cache, b.slot_mapping)
    got = cpu.paged_attention(
        b.query,
        b.k_cache,
        b.v_cache,
        AttentionMetadata.of(a.block_tables, a.seq_lens, a.query_start_loc),
        scale=b.scale,
    )
    return got, dense_attention(b).float()
