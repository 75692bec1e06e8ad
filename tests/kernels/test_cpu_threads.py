"""Multi-threaded engines: the C attention kernels run on runs of the batch's sequences at
once, one per thread (kernels/cpu.py). Each sequence's output must be the one-thread
output, bit for bit, whatever the split."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvroute.kernels import cpu, reference

from .batches import Batch, dense_attention, make_batch, tolerance

pytestmark = pytest.mark.skipif(
    not (cpu.decode_kernel_available() and cpu.prefill_kernel_available()),
    reason="C attention kernels not built",
)


def _attend(batch: Batch) -> torch.Tensor:
    return cpu.paged_attention(*batch.inputs(), scale=batch.scale)


def _batch(specs: list[tuple[int, int]], seed: int = 0) -> Batch:
    batch = make_batch(specs, num_heads=8, num_kv_heads=2, head_dim=64, seed=seed)
    reference.store_kv(
        batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping
    )
    return batch


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [2, 3, 4])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_the_split_over_threads_changes_no_bit(threads: None, num_threads: int, kind: str) -> None:
    specs = {  # (cached, new) per sequence
        "decode": [(300 + 37 * i, 1) for i in range(9)],
        "prefill": [(0, 200), (64, 150), (0, 333), (128, 90)],
        "mixed": [(400, 1), (0, 260), (512, 1), (96, 180), (700, 1), (33, 1)],
    }[kind]
    batch = _batch(specs, seed=num_threads)
    torch.set_num_threads(1)
    alone = _attend(batch)
    torch.set_num_threads(num_threads)
    before = cpu.num_parallel_calls
    split = _attend(batch)
    assert cpu.num_parallel_calls > before  # it did run on several threads
    assert torch.equal(split, alone)
    want = dense_attention(batch).to(split.dtype)
    torch.testing.assert_close(split, want, **tolerance(torch.float32))


def test_a_small_batch_stays_on_one_thread(threads: None) -> None:
    batch = _batch([(20, 1), (30, 1)])
    torch.set_num_threads(4)
    before = cpu.num_parallel_calls
    _attend(batch)
    assert cpu.num_parallel_calls == before


def test_runs_are_contiguous_and_balanced() -> None:
    runs = cpu._split(list(range(8)), [100.0] * 7 + [700.0], 4, 0.0)
    assert [r.tolist() for r in runs] == [[0, 1, 2, 3], [4, 5, 6], [7]]  # 400, 300, 700
    assert torch.cat(runs).tolist() == list(range(8))
    assert [r.tolist() for r in cpu._split([3, 1], [5.0, 5.0], 4, 100.0)] == [[3, 1]]
