"""The C prefill kernel (kernels/cpu_prefill.c) against the dense oracle: whole prompts and
chunks over cached prefixes, across the tile edges (8 query rows, 32 keys), head layouts
and block sizes; and the dispatch that sends it only what it can serve."""

from __future__ import annotations

import random

import pytest
import torch

from kvroute.kernels import KernelBackend, cpu, reference, select_backend

from .batches import dense_attention, make_batch, tolerance

pytestmark = pytest.mark.skipif(
    not (cpu.prefill_kernel_available() and cpu.decode_kernel_available()),
    reason="C kernels not built",
)

# (cached_len, q_len): tile edges of rows (7, 8, 9) and keys (31, 32, 33), short prompts,
# chunks whose first row sits just before, on and after a key tile's edge, a decode.
SPECS = [(0, 2), (0, 7), (0, 8), (0, 9), (0, 33), (0, 64), (31, 9), (32, 8), (33, 40), (5, 1)]


def _run(batch, backend: KernelBackend | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    reference.store_kv(
        batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping
    )
    attend = cpu.paged_attention if backend is None else backend.paged_attention
    return attend(*batch.inputs(), scale=batch.scale)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (9, 3), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_matches_dense(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> None:
    batch = make_batch(
        SPECS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        padding_rows=3,
        seed=head_dim + num_heads + block_size,
    )
    got = _run(batch)
    want = dense_attention(batch).float()
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    assert torch.all(got[batch.query_start_loc[-1] :] == 0)  # padding rows stay zero


def test_random_batches_match_dense() -> None:
    rng = random.Random(7)
    for trial in range(12):
        specs = [(rng.choice([0, 0, rng.randrange(200)]), rng.randrange(1, 150)) for _ in range(4)]
        batch = make_batch(specs, num_heads=6, num_kv_heads=2, head_dim=32, seed=trial)
        torch.testing.assert_close(
            _run(batch), dense_attention(batch).float(), **tolerance(torch.float32)
        )


def test_prefills_take_the_kernel_and_the_switch_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The torch path is never entered for an unwindowed prefill while the kernel is on;
    with KVROUTE_CPU_PREFILL_KERNEL=0 it is, and the outputs agree."""
    entered: list[int] = []
    real = reference.attend_prefills

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "attend_prefills", spy)
    batch = make_batch(SPECS, num_heads=4, num_kv_heads=2, head_dim=32, seed=3)
    fast = _run(batch)
    assert entered == []
    monkeypatch.setenv("KVROUTE_CPU_PREFILL_KERNEL", "0")
    slow = _run(batch, select_backend("cpu"))
    assert entered == [1]
    torch.testing.assert_close(fast, slow, **tolerance(torch.float32))


def test_what_the_kernel_cannot_serve_takes_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head_dim that is not a multiple of 16 and a prefill the window cuts both go to
    SDPA, and stay exact."""
    calls: list[list[int] | None] = []
    real = reference.attend_prefills

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seqs = args[9] if len(args) > 9 else kwargs.get("seqs")
        calls.append(None if seqs is None else list(seqs))
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "attend_prefills", spy)
    odd = make_batch(SPECS, num_heads=4, num_kv_heads=2, head_dim=24, seed=4)
    torch.testing.assert_close(_run(odd), dense_attention(odd).float(), **tolerance(torch.float32))
    assert calls == [[i for i, (_, q) in enumerate(SPECS) if q > 1]]

    window = 16
    specs = [(0, 40), (0, 10), (30, 5)]  # the first and last are cut by the window
    batch = make_batch(specs, num_heads=4, num_kv_heads=2, head_dim=32, seed=5)
    reference.store_kv(
        batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping
    )
    got = cpu.paged_attention(*batch.inputs(), scale=batch.scale, sliding_window=window)
    assert calls[-1] == [0, 2]  # only the windowed ones; the uncut prompt took the kernel
    want = reference.paged_attention(*batch.inputs(), scale=batch.scale, sliding_window=window)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
